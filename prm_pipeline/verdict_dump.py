"""``prm-pipeline verdicts``: print verdicts as JSON lines (format in docs/jsonl.md).

Reads with a throw-away consumer (no consumer group, nothing committed), so dumping
never disturbs the trainer's offsets. "Only new verdicts" is implemented as "records
timestamped after start-up", read from the beginning: the embedded broker reports
wrong end offsets, and timestamps work the same on every broker.

``--since TIME`` (:func:`parse_time`: ISO-8601 or a relative age such as ``15m``,
``2h``, ``1d12h``) keeps records timestamped at or after TIME. Where the broker can
look the time up (``offsets_for_times``) reading starts there; the timestamp filter
still applies, so a broker that answers wrongly (the embedded one returns offset 0 for
future times) only costs a longer read, never a wrong answer.

``--experiment ID`` reads that experiment's topic (``prm.verdicts.ID``; docs/fleet.md);
a verdict there that names another experiment was published to the wrong topic: it is
not printed, and the summary counts it. The default topic also carries the workers'
``unknown_experiment`` rejections, which name the undeclared experiment: they are counted
apart, pointing at the dead letters that hold those records.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

import msgspec

from infra.config import ConfigError, PipelineConfig
from infra.escape import printable
from infra.experiments import DEFAULT_EXPERIMENT, verdicts_topic
from infra.jsonl import dump_verdict
from infra.kafka import assign_from_start, make_consumer
from infra.readback import VerdictTokens, needs_tokens
from infra.reasons import UNKNOWN_EXPERIMENT
from infra.schema import SchemaError, decode_verdict
from prm_pipeline.token_view import verdict_record

# How long a topic may take to show in fresh metadata before it is reported missing (a
# topic created a moment ago; a real cluster can take a moment to propagate it). Also
# prm-pipeline status's, under its own read bound.
TOPIC_WAIT_S = 3.0

_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0}
_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")


def parse_time(text: str, *, now: float | None = None) -> int:
    """A ``--since`` value -> Unix time in milliseconds (Kafka record timestamps).

    Accepted forms:

    * a relative age, one or more ``<number><unit>`` with units ``ms s m h d w``:
      ``15m``, ``2h``, ``1d12h``, ``1.5h`` (meaning *that long before now*);
    * ISO-8601: ``2026-11-30``, ``2026-11-30T14:05``, ``2026-11-30T14:05:00Z``,
      ``2026-11-30 14:05:00+01:00``. A time without a zone is the machine's local time.

    Raises :class:`ValueError` with the accepted forms for anything else, and for a
    time in the future (it would select nothing).
    """
    raw = text.strip()
    now_s = time.time() if now is None else now
    if not raw:
        raise ConfigError("empty time; use ISO-8601 (2026-11-30T14:05:00Z) or an age like 15m, 2h, 1d")
    compact = raw.replace(" ", "")
    if "".join(m.group(0) for m in _RELATIVE.finditer(compact)) == compact:
        seconds = sum(float(n) * _UNITS_S[u] for n, u in _RELATIVE.findall(compact))
        return round((now_s - seconds) * 1000)
    try:
        when = datetime.fromisoformat(raw.replace("z", "Z"))
    except ValueError:
        raise ConfigError(
            f"cannot read time {text!r}; use ISO-8601 (2026-11-30T14:05:00Z, 2026-11-30 14:05, "
            "2026-11-30) or an age before now like 90s, 15m, 2h, 1d12h"
        ) from None
    ms = round(when.timestamp() * 1000)  # naive -> local time (datetime's rule)
    if ms > now_s * 1000 + 1000:
        raise ConfigError(f"time {text!r} is in the future; nothing would be selected")
    return ms


def since_arg(text: str) -> int:
    """``argparse`` ``type=`` for ``--since``: :func:`parse_time` with an argparse error."""
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class DumpCounts:
    """What a dump printed: ``verdicts`` lines, of ``groups`` distinct groups; ``repeats``
    are verdicts of an ``(experiment_id, group_id, verdict_version)`` printed before (a
    re-publish after a worker crash or a retried send), which the trainer's dedupe drops;
    ``other_experiment`` verdicts named another experiment than the topic's and were not printed."""

    verdicts: int = 0
    groups: int = 0
    repeats: int = 0
    other_experiment: int = 0
    unknown_experiment: int = 0  # of other_experiment: workers' rejections of an undeclared experiment

    def summary(self) -> str:
        other = (
            f"; {self.other_experiment} verdicts of another experiment on this topic were skipped"
            if self.other_experiment
            else ""
        )
        if self.unknown_experiment:
            other += (
                f" ({self.unknown_experiment} of them rejections `unknown_experiment` of an undeclared "
                "experiment: `prm-pipeline dead-letters` lists their records, error class UnknownExperiment)"
            )
        if not self.repeats:
            return f"{self.verdicts} verdicts{other}"
        return (
            f"{self.verdicts} verdicts of {self.groups} groups: {self.repeats} repeated an (experiment_id, "
            f"group_id, verdict_version) already printed (a re-published verdict; the trainer keeps the first)"
            f"{other}"
        )


async def _dump(
    cfg: PipelineConfig,
    out: IO[str],
    *,
    from_beginning: bool,
    max_count: int | None,
    timeout_s: float | None,
    since_ms: int | None = None,
    tokens: bool = False,
    counts: DumpCounts | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
    waiting: IO[str] | None = None,
) -> int:
    """``waiting``: where to say, once, that nothing has arrived yet and the dump waits (a terminal)."""
    counts = counts if counts is not None else DumpCounts()
    seen: set[tuple[str, str, int]] = set()
    start_ms = since_ms if since_ms is not None else (0 if from_beginning else int(time.time() * 1000))
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    readback = VerdictTokens(cfg)  # verdicts published with worker.verdict_tokens: reference
    count = 0
    try:
        # a missing topic is TopicMissing (one line, exit 1) after a short wait for fresh metadata
        topic = verdicts_topic(cfg.topics.verdicts, experiment)
        tps = await assign_from_start(consumer, topic, timeout_s=TOPIC_WAIT_S)
        if since_ms is not None:
            await seek_to_time(consumer, tps, since_ms)
        last_new = time.monotonic()
        encoder = msgspec.json.Encoder()
        while max_count is None or count < max_count:
            batch = await consumer.getmany(timeout_ms=200)
            records = [r for rs in batch.values() for r in rs]
            if not records and timeout_s is not None and time.monotonic() - last_new > timeout_s:
                break
            if not records and not count and waiting is not None:  # a silent terminal looks hung
                print(f"waiting for verdicts on {topic} (Ctrl-C to stop)", file=waiting, flush=True)
                waiting = None
            verdicts = []
            for record in records:
                if record.timestamp < start_ms:
                    continue
                try:
                    verdict = decode_verdict(record.value, record.headers)
                except SchemaError as exc:
                    print(
                        printable(f"skipping undecodable verdict at {record.partition}:{record.offset}: {exc}"),
                        file=sys.stderr,
                    )
                    continue
                if verdict.experiment_id != experiment:
                    counts.other_experiment += 1
                    counts.unknown_experiment += verdict.reason_code == UNKNOWN_EXPERIMENT
                    continue
                verdicts.append(verdict)
            if any(needs_tokens(v) for v in verdicts):  # the turns (and the status) the trainer sees
                verdicts = await readback.resolve(verdicts)
            for verdict in verdicts:
                line = verdict_record(verdict) if tokens else dump_verdict(verdict)
                out.write(encoder.encode(line).decode() + "\n")
                count += 1
                key = (verdict.experiment_id, verdict.group_id, verdict.verdict_version)
                if key in seen:
                    counts.repeats += 1
                else:
                    seen.add(key)
                    counts.groups += 1
                last_new = time.monotonic()
                if max_count is not None and count >= max_count:
                    break
            out.flush()
    finally:
        await consumer.stop()
        await readback.aclose()
    counts.verdicts = count
    return count


async def seek_to_time(consumer: Any, tps: Any, since_ms: int) -> None:
    """Start each partition at its first record timestamped >= ``since_ms`` where the
    broker can say; otherwise leave it where it is (callers also filter by timestamp)."""
    try:
        found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
    except Exception as exc:  # noqa: BLE001 - an optimisation only: an old/partial broker may refuse
        print(
            f"offsets_for_times unavailable ({type(exc).__name__}: {exc}); reading from the beginning", file=sys.stderr
        )
        return
    for tp, hit in found.items():
        if hit is not None and hit.offset > 0:
            consumer.seek(tp, hit.offset)


def dump_verdicts(
    cfg: PipelineConfig,
    *,
    from_beginning: bool,
    max_count: int | None,
    timeout_s: float | None,
    out: str | None,
    since_ms: int | None = None,
    tokens: bool = False,
    experiment: str = DEFAULT_EXPERIMENT,
) -> int:
    """Print (or write to ``out``) verdict JSON lines; the summary line goes to stderr.

    ``tokens`` keeps each member's token ids (``interactions``, plus ``policy_version``):
    the form ``prm-pipeline inspect --verdicts`` reads. ``experiment`` picks the topic.
    """
    fh = open(out, "w") if out else sys.stdout
    counts = DumpCounts()
    try:
        asyncio.run(
            _dump(
                cfg,
                fh,
                from_beginning=from_beginning,
                max_count=max_count,
                timeout_s=timeout_s,
                since_ms=since_ms,
                tokens=tokens,
                counts=counts,
                experiment=experiment,
                waiting=sys.stderr if sys.stderr.isatty() else None,
            )
        )
    except KeyboardInterrupt:
        return 130
    finally:
        if out:
            fh.close()
    print(counts.summary(), file=sys.stderr)
    return 0
