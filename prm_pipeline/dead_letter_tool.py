"""``prm-pipeline dead-letters``: read the dead-letter topic, and redrive chosen records.

Reading prints one JSON line per dead letter with its headers decoded (why it was
dead-lettered, where the original record was, which worker gave up) and, where this
build can decode the payload, what it holds (kind, group, trajectory; every kind of the
trajectories topic: ``ready``, ``discard``, ``chunk`` and a streamed session's ``turn``
and ``end``). ``--since``,
``--follow`` and ``--out`` work as for ``verdicts``.

``--redrive`` republishes chosen dead letters to the trajectories topic after a fix (a
worker upgraded to a newer schema, a scorer bug fixed). It is a **dry run** unless
``--yes``: the plan lists every chosen record with why it was dead-lettered and whether
it would be republished. A record is skipped when republishing cannot help: its payload
was cut when it was dead-lettered, this build still cannot decode it (it would be
dead-lettered again), or its trajectory was already chosen earlier in the same run.
Across runs, workers make a redrive idempotent by ``trajectory_id``: their ledger
acknowledges a trajectory it has already parked or whose group it has decided.

Experiments (docs/fleet.md): a dead letter belongs to the experiment whose trajectories
topic it came from, whatever its payload names (the topic is the tenant); ``--experiment
ID`` keeps only that experiment's letters, in the listing and in a redrive, and a redrive
republishes each record to the topic it came from. A record that names another
experiment than its topic's (``ExperimentMismatch``) is never redriven: it would be
refused again, and only its producer may publish to the experiment it names.

A republished record keeps its payload, key and original headers, plus
``prm-redriven-from`` (the dead letter's coordinates) and ``prm-redriven-source`` (the
original record's), so a record dead-lettered again shows its history. The tool needs
only Read on the dead-letter topic and Write on the trajectories topic (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from infra.config import PipelineConfig
from infra.escape import json_line, printable
from infra.experiments import DEFAULT_EXPERIMENT, UnknownExperiment, experiment_of_topic, trajectories_topic
from infra.schema import (
    ALL_KINDS,
    DeadLetter,
    DiscardGroup,
    ExperimentMismatch,
    InvalidMessage,
    SchemaError,
    SessionEnd,
    SessionTurn,
    TrajectoryChunk,
    TrajectoryMessage,
    dead_letter_from_record,
    decode_message,
    kind_of,
)

log = logging.getLogger(__name__)

REDRIVEN_FROM_HEADER = "prm-redriven-from"
REDRIVEN_SOURCE_HEADER = "prm-redriven-source"
# Classes a worker gives a record it could not decode (infra.schema's SchemaError family).
SCHEMA_ERROR_CLASSES = frozenset(
    {"SchemaError", "UnknownSchemaVersion", "UnknownMessageKind", "InvalidMessage", ExperimentMismatch.__name__}
)


def trajectory_of(message: TrajectoryMessage) -> str | None:
    """The trajectory a record belongs to; ``None`` for a group's discard."""
    return None if isinstance(message, DiscardGroup) else message.trajectory_id


def part_of(message: TrajectoryMessage) -> str:
    """Which part of its trajectory a record carries: ``""`` for a whole one (``ready``) or a
    discard, ``turn ID`` / ``end`` for a streamed session's records, ``chunk I/N``."""
    if isinstance(message, SessionTurn):
        return f"turn {message.interaction.interaction_id}"
    if isinstance(message, SessionEnd):
        return "end"
    if isinstance(message, TrajectoryChunk):
        return f"chunk {message.index}/{message.count}"
    return ""


@dataclass(frozen=True)
class LetterRecord:
    """One record of the dead-letter topic: where it is, and the :class:`DeadLetter` it holds."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    letter: DeadLetter

    @property
    def coordinates(self) -> str:
        return f"{self.topic}:{self.partition}@{self.offset}"

    @property
    def source(self) -> str:
        return f"{self.letter.source_topic}:{self.letter.source_partition}@{self.letter.source_offset}"

    @property
    def truncated(self) -> bool:
        return self.letter.original_size >= 0

    @property
    def key_text(self) -> str | None:
        if self.key is None:
            return None
        return self.key.decode(errors="replace")

    def original_headers(self) -> list[tuple[str, bytes]]:
        return [(k, v.encode()) for k, v in self.letter.original_headers.items()]

    def decoded(self) -> TrajectoryMessage | SchemaError:
        """The payload decoded with this build, or why it does not decode."""
        try:
            return decode_message(self.letter.payload, self.original_headers(), kinds=ALL_KINDS)
        except SchemaError as exc:
            return exc

    def experiment(self, trajectories_base: str) -> str | None:
        """The experiment of this letter: the one whose trajectories topic
        (``trajectories_base`` or ``<trajectories_base>.<id>``) it came from, never the one
        its payload names; ``None`` when the topic is no experiment's."""
        return experiment_of_topic(trajectories_base, self.letter.source_topic)

    def to_json(self, *, payload: bool = False, trajectories_base: str | None = None) -> dict[str, Any]:
        """The JSON line ``dead-letters`` prints (docs/faults.md)."""
        d = self.letter
        out: dict[str, Any] = {
            "dead_letter": self.coordinates,
            "timestamp": _iso(self.timestamp_ms),
            "key": self.key_text,
            "error_class": d.error_class,
            "error_message": d.error_message,
            "source": self.source,
            "attempt": d.attempt,
            "worker_id": d.worker_id,
            "original_headers": d.original_headers,
            "payload_bytes": len(d.payload),
        }
        if self.truncated:
            out["original_size"] = d.original_size
        message = self.decoded()
        if isinstance(message, SchemaError):
            out["decode_error"] = f"{type(message).__name__}: {message}"
        else:
            out["kind"] = kind_of(message)
            out["group_id"] = message.group_id
            if (trajectory := trajectory_of(message)) is not None:
                out["trajectory_id"] = trajectory
            if isinstance(message, SessionTurn):
                out["interaction_id"] = message.interaction.interaction_id
            elif isinstance(message, TrajectoryChunk):
                out["chunk"] = f"{message.index}/{message.count}"
        if trajectories_base is not None:
            experiment = self.experiment(trajectories_base)
            if experiment is not None and experiment != DEFAULT_EXPERIMENT:
                out["experiment_id"] = experiment
        if payload:
            out["payload_base64"] = base64.b64encode(d.payload).decode()
        return out


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


# --------------------------------------------------------------------------- selection and plan
@dataclass(frozen=True)
class Selection:
    """Which dead letters ``--redrive`` considers. Kinds of selector AND together; the values
    of one kind OR (``--reason A --reason B`` is either class). Empty: every letter read."""

    offsets: frozenset[tuple[int, int]] = frozenset()
    trajectories: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    reasons: frozenset[str] = frozenset()
    experiment: str | None = None  # only this experiment's letters (LetterRecord.experiment)
    trajectories_base: str = "prm.trajectories"  # topics.trajectories, to tell a letter's experiment

    def matches(self, rec: LetterRecord, message: TrajectoryMessage | SchemaError) -> bool:
        if self.offsets and (rec.partition, rec.offset) not in self.offsets:
            return False
        if self.experiment is not None and rec.experiment(self.trajectories_base) != self.experiment:
            return False
        if self.reasons and rec.letter.error_class not in self.reasons:
            return False
        group = None if isinstance(message, SchemaError) else message.group_id
        if self.groups and group not in self.groups and rec.key_text not in self.groups:
            return False
        if self.trajectories:
            return not isinstance(message, SchemaError) and trajectory_of(message) in self.trajectories
        return True


@dataclass(frozen=True)
class PlanEntry:
    """What a redrive does with one chosen dead letter: republish it, or skip it and why."""

    record: LetterRecord
    redrive: bool
    why_skipped: str = ""
    group_id: str | None = None
    trajectory_id: str | None = None
    note: str = ""
    experiment: str | None = None  # its experiment: the redrive goes to that experiment's topic
    part: str = ""  # part_of the record: "turn ID", "end", "chunk I/N"; "" for a whole trajectory or a discard

    @property
    def what(self) -> str:
        """What the record holds, in words (``turn t-3 of trajectory t of group g``)."""
        if self.trajectory_id:
            return f"{self.part + ' of ' if self.part else ''}trajectory {self.trajectory_id} of group {self.group_id}"
        return f"discard of group {self.group_id}" if self.group_id else "undecodable record"

    def describe(self) -> str:
        rec, d = self.record, self.record.letter
        what = self.what
        if self.experiment not in (None, DEFAULT_EXPERIMENT):
            what += f" (experiment {self.experiment})"
        why = (
            f"dead-lettered from {rec.source} by {d.worker_id or '?'} after {d.attempt} attempt(s): "
            f"{d.error_class}: {d.error_message[:300]}"
        )
        head = f"redrive {rec.coordinates}" if self.redrive else f"skip    {rec.coordinates}"
        tail = f"; {self.note}" if self.note and self.redrive else ""
        skipped = f" -- skipped: {self.why_skipped}" if not self.redrive else ""
        return printable(f"{head}: {what}; {why}{skipped}{tail}")  # ids and messages are the records' text


def plan_redrive(records: Iterable[LetterRecord], selection: Selection) -> list[PlanEntry]:
    """The redrive plan for ``records`` (pure: nothing is read or sent here)."""
    entries: list[PlanEntry] = []
    # trajectory id (plus the part: a turn, the end, a chunk; or discard:<group>) -> the dead letter first chosen for it
    chosen: dict[str, str] = {}
    for rec in records:
        message = rec.decoded()
        if not selection.matches(rec, message):
            continue
        if rec.truncated:
            entries.append(
                PlanEntry(
                    rec,
                    False,
                    (
                        f"the payload was cut to {len(rec.letter.payload)} of {rec.letter.original_size} bytes when "
                        f"it was "
                        f"dead-lettered; republish the original from {rec.source} (while the topic retains it)"
                    ),
                )
            )
            continue
        if isinstance(message, SchemaError):
            entries.append(
                PlanEntry(
                    rec,
                    False,
                    (
                        f"this build still cannot decode it ({type(message).__name__}: {str(message)[:200]}); "
                        "it would be dead-lettered again"
                    ),
                )
            )
            continue
        traj, part = trajectory_of(message), part_of(message)
        if rec.letter.error_class == ExperimentMismatch.__name__:
            entries.append(
                PlanEntry(
                    rec,
                    False,
                    (
                        "it names another experiment than the topic it came from; it would be refused again (only "
                        "its producer may publish it, to its own experiment's topic)"
                    ),
                    message.group_id,
                    traj,
                    part=part,
                )
            )
            continue
        experiment = rec.experiment(selection.trajectories_base)
        ident = (f"{traj}/{part}" if part else traj) if traj is not None else f"discard:{message.group_id}"
        ident = f"{experiment}/{ident}"  # ids are per experiment
        if ident in chosen:
            entries.append(
                PlanEntry(
                    rec, False, f"already redriven from {chosen[ident]} in this run", message.group_id, traj, part=part
                )
            )
            continue
        chosen[ident] = rec.coordinates
        entries.append(
            PlanEntry(
                rec,
                True,
                "",
                message.group_id,
                traj,
                _rejection_note(rec, message, experiment),
                experiment,
                part,
            )
        )
    return entries


def _rejection_note(rec: LetterRecord, message: TrajectoryMessage, experiment: str | None) -> str:
    """Workers reject the group a dead letter names (``invalid_member``) when they write it;
    say so, because a redriven member of a decided group is acknowledged, not scored.
    ``experiment`` is the letter's (its source topic's), the one a worker found undeclared:
    the payload may name none (it belongs to its topic's) or be a chunk (it has no field)."""
    keyed = rec.key_text is not None
    if not keyed and rec.letter.error_class in SCHEMA_ERROR_CLASSES:
        return ""  # an undecodable record without a key named no group: none was rejected
    # a record naming an experiment no worker serves (docs/fleet.md): rejected without touching the ledger
    if rec.letter.error_class == UnknownExperiment.__name__:
        which = (
            f"experiment {experiment!r}"
            if experiment is not None
            else f"the experiment of topic {rec.letter.source_topic}"
        )
        return (
            f"workers rejected group {message.group_id} (unknown_experiment) without remembering it: once "
            f"{which} is declared (prm-pipeline experiment add), the redriven record is scored; before that it "
            "is dead-lettered again"
        )
    return (
        f"workers rejected group {message.group_id} (invalid_member) when they dead-lettered this record; "
        "while they remember it (worker.dedupe_window_s) they acknowledge the redriven record without a "
        "new verdict"
    )


# --------------------------------------------------------------------------- Kafka
async def read_letters(
    cfg: PipelineConfig,
    *,
    since_ms: int | None = None,
    follow: bool = False,
    on_letter: Callable[[LetterRecord], None] | None = None,
    stop: asyncio.Event | None = None,
    idle_end_s: float = 3.0,
) -> list[LetterRecord]:
    """Dead letters from the beginning (or ``since_ms``) to the topic's end; with ``follow``,
    keep reading until ``stop`` is set. A throw-away consumer: no group, nothing committed.

    The end is each partition's high-water mark seen after a fetch (the embedded broker's
    ``end_offsets`` is wrong); a partition that reports none (empty, on some brokers) ends
    the read after ``idle_end_s`` without records.
    """
    from infra.kafka import assign_from_start, make_consumer
    from prm_pipeline.verdict_dump import seek_to_time

    topic = cfg.topics.dead_letters
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    out: list[LetterRecord] = []
    try:
        tps = await assign_from_start(consumer, topic)
        if since_ms is not None:
            await seek_to_time(consumer, tps, since_ms)
        last_new = time.monotonic()
        while stop is None or not stop.is_set():
            batch = await consumer.getmany(timeout_ms=200)
            records = sorted((r for rs in batch.values() for r in rs), key=lambda r: (r.partition, r.offset))
            for r in records:
                last_new = time.monotonic()
                if since_ms is not None and r.timestamp < since_ms:
                    continue
                try:
                    letter = dead_letter_from_record(r.value, r.headers or ())
                except InvalidMessage as exc:  # a corrupt record is skipped with a word, never stops the tool
                    print(printable(f"warning: {r.topic}:{r.partition}@{r.offset} skipped: {exc}"), file=sys.stderr)
                    continue
                rec = LetterRecord(r.topic, r.partition, r.offset, r.timestamp, r.key, letter)
                out.append(rec)
                if on_letter is not None:
                    on_letter(rec)
            if follow or records:
                continue
            highs = [consumer.highwater(tp) for tp in tps]
            if all(h is not None for h in highs):
                positions = [await consumer.position(tp) for tp in tps]
                if all(p >= h for p, h in zip(positions, highs)):
                    break
            elif time.monotonic() - last_new > idle_end_s:
                break
    finally:
        await consumer.stop()
    return out


@dataclass
class RedriveResult:
    sent: list[tuple[PlanEntry, str]] = field(default_factory=list)  # entry, new coordinates
    skipped: list[PlanEntry] = field(default_factory=list)


async def redrive(cfg: PipelineConfig, entries: Sequence[PlanEntry], *, out: IO[str]) -> RedriveResult:
    """Republish the plan's chosen records to their experiments' trajectories topics, one line each."""
    from infra.kafka import make_producer

    result = RedriveResult(skipped=[e for e in entries if not e.redrive])
    todo = [e for e in entries if e.redrive]
    if not todo:
        return result
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for entry in todo:
            rec = entry.record
            headers = [
                *rec.original_headers(),
                (REDRIVEN_FROM_HEADER, rec.coordinates.encode()),
                (REDRIVEN_SOURCE_HEADER, rec.source.encode()),
            ]
            key = rec.key if rec.key is not None else (entry.group_id or "").encode() or None
            topic = trajectories_topic(cfg.topics.trajectories, entry.experiment or DEFAULT_EXPERIMENT)
            meta = await producer.send_and_wait(topic, rec.letter.payload, key=key, headers=headers)
            where = f"{meta.topic}:{meta.partition}@{meta.offset}"
            result.sent.append((entry, where))
            line = (
                f"redriven {rec.coordinates} (originally {rec.source}, {rec.letter.error_class}) -> {where}: "
                f"{entry.what}"
            )
            log.info("%s", line)
            print(printable(line), file=out, flush=True)
    finally:
        await producer.stop()
    return result


# --------------------------------------------------------------------------- CLI
_OFFSET = re.compile(r"(?:(?P<topic>.+):)?(?P<partition>\d+)[:@](?P<offset>\d+)")


def parse_offsets(text: str) -> set[tuple[str | None, int, int]]:
    """``--offsets``: dead letters of the dead-letter topic as ``(topic, partition, offset)``.

    Each comma-separated item is ``PARTITION:OFFSET``, ``PARTITION@OFFSET`` or the
    ``dead_letter`` field's own form ``TOPIC:PARTITION@OFFSET`` (``prm.dead-letters:3@0``:
    copied from the listing); ``topic`` is None where the item names none.
    """
    found: set[tuple[str | None, int, int]] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _OFFSET.fullmatch(part)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"expected PARTITION:OFFSET or TOPIC:PARTITION@OFFSET (the dead_letter field), comma-separated; "
                f"got {part!r}"
            )
        found.add((match["topic"], int(match["partition"]), int(match["offset"])))
    return found


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from infra.config import load_config

    cfg = load_config(args.config)
    selectors = bool(args.offsets or args.trajectory or args.group or args.reason)
    if args.redrive and args.follow:
        print("dead-letters: --redrive works on what is in the topic now; drop --follow", file=sys.stderr)
        return 2
    if (selectors or args.yes) and not args.redrive:
        print(
            "dead-letters: --offsets/--trajectory/--group/--reason/--yes choose what --redrive republishes; "
            "add --redrive",
            file=sys.stderr,
        )
        return 2
    if args.redrive and args.out:
        print(
            "dead-letters: --out writes the listing; --redrive prints its plan to stdout (redirect it); drop --out",
            file=sys.stderr,
        )
        return 2
    if args.experiment is not None:
        _note_if_removed(cfg, args.experiment)
    if not args.redrive:
        return _list(cfg, args)
    chosen = [o for spec in args.offsets or () for o in spec]
    stray = sorted({topic for topic, _, _ in chosen if topic not in (None, cfg.topics.dead_letters)})
    if stray:
        print(
            f"dead-letters: --offsets names {stray}; the dead letters are in {cfg.topics.dead_letters!r}",
            file=sys.stderr,
        )
        return 2
    selection = Selection(
        offsets=frozenset((p, o) for _, p, o in chosen),
        trajectories=frozenset(args.trajectory or ()),
        groups=frozenset(args.group or ()),
        reasons=frozenset(args.reason or ()),
        experiment=args.experiment,
        trajectories_base=cfg.topics.trajectories,
    )
    records = asyncio.run(read_letters(cfg, since_ms=args.since))
    entries = plan_redrive(records, selection)
    read = {(r.partition, r.offset) for r in records}
    if unmatched := sorted(selection.offsets - read):
        print(
            f"dead-letters: --offsets {', '.join(f'{p}:{o}' for p, o in unmatched)} "
            f"{'matches' if len(unmatched) == 1 else 'match'} no dead letter read from {cfg.topics.dead_letters} "
            f"({len(records)} read{', --since' if args.since is not None else ''})",
            file=sys.stderr,
        )
    out = sys.stdout
    for entry in entries:
        print(entry.describe(), file=out)
    n_redriven = sum(e.redrive for e in entries)
    skipped = len(entries) - n_redriven
    topic = (
        trajectories_topic(cfg.topics.trajectories, args.experiment)
        if args.experiment
        else f"{cfg.topics.trajectories} (each record to its experiment's topic)"
    )
    if not args.yes:
        print(
            f"dry run: would redrive {n_redriven} of {len(entries)} chosen dead letters ({len(records)} read) to "
            f"{topic}, {skipped} skipped; nothing was published. Rerun with --yes to republish.",
            file=out,
        )
        return 0
    result = asyncio.run(redrive(cfg, entries, out=out))
    print(
        f"redrove {len(result.sent)} of {len(entries)} chosen dead letters ({len(records)} read) to {topic}, "
        f"{len(result.skipped)} skipped",
        file=out,
    )
    return 0


def _note_if_removed(cfg: PipelineConfig, experiment: str) -> None:
    """Say so when ``--experiment`` names a removed experiment (its letters are still listed and
    redriven); an undeclared one is no error here: its records are dead letters too."""
    from infra.registry import recorded_experiment, removed_note

    try:
        recorded = asyncio.run(recorded_experiment(cfg, experiment))
    except UnknownExperiment:
        return
    if recorded.removed:
        print(removed_note(cfg, recorded), file=sys.stderr)


def _list(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    fh = open(args.out, "w") if args.out else sys.stdout
    count = 0

    def emit(rec: LetterRecord) -> None:
        nonlocal count
        if args.experiment is not None and rec.experiment(cfg.topics.trajectories) != args.experiment:
            return
        fh.write(json_line(rec.to_json(payload=args.payload, trajectories_base=cfg.topics.trajectories)) + "\n")
        fh.flush()
        count += 1

    async def main() -> None:
        stop = asyncio.Event()
        if args.follow:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        await read_letters(cfg, since_ms=args.since, follow=args.follow, on_letter=emit, stop=stop)

    try:
        asyncio.run(main())
    finally:
        if args.out:
            fh.close()
    which = f" of experiment {args.experiment}" if args.experiment is not None else ""
    print(f"{count} dead letters{which} in {cfg.topics.dead_letters}", file=sys.stderr)
    return 0


def dead_letters_arguments(p: argparse.ArgumentParser) -> None:
    """``prm-pipeline dead-letters``'s flags (the command is described in prm_pipeline.cli.COMMANDS)."""
    from prm_pipeline.verdict_dump import since_arg

    p.add_argument(
        "--since",
        type=since_arg,
        metavar="TIME",
        default=None,
        help="only dead letters timestamped at/after TIME: ISO-8601 or an age like 15m, 2h, 1d",
    )
    p.add_argument("--follow", action="store_true", help="keep printing new dead letters until Ctrl-C")
    p.add_argument("--out", default=None, metavar="FILE", help="write the JSON lines to FILE instead of stdout")
    p.add_argument("--payload", action="store_true", help="include each payload (base64) in the JSON lines")
    p.add_argument(
        "--redrive",
        action="store_true",
        help="republish chosen dead letters to the trajectories topic (a dry run unless --yes)",
    )
    p.add_argument("--yes", action="store_true", help="with --redrive: really republish")
    p.add_argument(
        "--offsets",
        type=parse_offsets,
        action="append",
        metavar="P:O[,P:O...]",
        help="with --redrive: only these dead letters of the dead-letter topic: PARTITION:OFFSET, or "
        "the dead_letter field as printed (prm.dead-letters:3@0)",
    )
    p.add_argument("--trajectory", action="append", metavar="ID", help="with --redrive: only this trajectory id")
    p.add_argument("--group", action="append", metavar="ID", help="with --redrive: only records of this group")
    p.add_argument(
        "--reason",
        action="append",
        metavar="CLASS",
        help="with --redrive: only dead letters of this error class (e.g. UnknownSchemaVersion)",
    )
    from prm_pipeline.experiment_option import add_experiment_option

    add_experiment_option(
        p,
        "only this experiment's dead letters (the experiment the payload names, else the "
        "trajectories topic it came from); default: every experiment's",
    )
