"""Shared machinery of the fault-injection tests.

* :func:`fault_config` — a per-test config (own topics, consumer group, Redis key prefix,
  short group-join timeouts, the test scorers on the allow-list).
* :class:`FaultWorkers` — ``prm-pipeline worker`` processes that can be SIGKILLed,
  SIGTERMed *without waiting* (a graceful stop overlapping the next start, which is what
  makes a rebalance storm) and restarted, with their log files for error counts.
* :class:`VerdictTail` — a background reader of the verdicts topic: progress (groups with
  a verdict) and the producer timestamp of every verdict record, so faults are paced by
  progress and recovery is measured (first verdict *produced* after the fault), never
  slept for.
* :class:`PacedLoad` — publishes groups in waves while keeping a bounded number of groups
  in flight, re-publishing a wave whose delivery failed (an at-least-once producer, as a
  rollout proxy must be when the broker restarts).
* :func:`check_verdicts` — the trainer's view: dedupe on ``(group_id, verdict_version)``,
  then exactly one distinct verdict per expected group, none missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from infra.config import (
    PipelineConfig,
    PRMScorerConfig,
)
from infra.kafka import assign_from_start, make_consumer
from infra.schema import (
    GroupVerdict,
    ReadyTrajectory,
    TrajectoryMessage,
    decode_verdict,
)
from producers.publisher import PublishError, TrajectoryPublisher
from tests.integration.harness import WorkerProcesses, isolated_config
from tests.polling import eventually, poll_until

log = logging.getLogger(__name__)

POLL_S = 0.05  # pause before reading again after a read error (the broker restarting)


def fault_config(
    name: str,
    kafka_bootstrap: str,
    redis_url: str,
    *,
    scorers: Sequence[PRMScorerConfig],
    partitions: int = 4,
    kafka: dict[str, Any] | None = None,
    **worker: Any,
) -> PipelineConfig:
    """:func:`isolated_config` with the fault suite's defaults (long deadline, short drain)."""
    worker.setdefault("group_timeout_s", 120)
    worker.setdefault("drain_timeout_s", 5)
    return isolated_config(
        f"fault-{name}",
        kafka_bootstrap,
        redis_url,
        scorers=scorers,
        partitions=partitions,
        kafka={"linger_ms": 2, **(kafka or {})},
        **worker,
    )


def report(scenario: str, **figures: Any) -> None:
    """Print one scenario's figures (visible with ``pytest -s``)."""
    lines = []
    for k, v in figures.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            lines.append(f"    {k}:")
            lines += [f"      - {x}" for x in v]
        else:
            lines.append(f"    {k:<32} {v}")
    print(f"\n[faults] {scenario}\n" + "\n".join(lines), flush=True)


# --------------------------------------------------------------------------- workers
class FaultWorkers(WorkerProcesses):
    """Worker processes for fault injection.

    ``terminate(i)`` sends SIGTERM and lets slot ``i`` be started again at once while the
    old process still drains (it is kept in ``retiring`` and reaped by :meth:`stop`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retiring: list[tuple[subprocess.Popen[bytes], Path]] = []  # (process, its log)
        self.events: Counter[str] = Counter()

    def start(self, i: int | None = None) -> None:
        super().start(i)
        self.events["start"] += 1 if i is not None else len(self.procs)

    def kill(self, i: int) -> None:
        if self.procs[i] is not None and self.procs[i].poll() is None:
            self.events["sigkill"] += 1
        super().kill(i)

    def terminate(self, i: int) -> None:
        self._note_exit(i)
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            self.ended_on_purpose.add(proc.pid)
            proc.send_signal(signal.SIGTERM)
            self.retiring.append((proc, self.current_log(i)))
            self.events["sigterm"] += 1
        self.procs[i] = None

    def stop(self, timeout_s: float = 10.0) -> list[int | None]:
        """SIGTERM every slot; returns their exit codes (see :meth:`final_exits`)."""
        self._final_logs = [self.current_log(i) if p is not None else None for i, p in enumerate(self.procs)]
        self.final_codes = super().stop(timeout_s)
        for p, _ in self.retiring:
            self._wait(p, timeout_s)
        return self.final_codes

    def final_exits(self) -> list[tuple[int | None, bool]]:
        """``(exit code, had started polling)`` of the processes :meth:`stop` ended."""
        return [
            (code, log is not None and "polling" in log.read_text(errors="replace"))
            for code, log in zip(self.final_codes, self._final_logs)
        ]

    def graceful_exits(self) -> list[tuple[int, bool]]:
        """``(exit code, had started polling)`` of each SIGTERMed process (waits for them).

        A SIGTERM that lands while the process is still importing (before the worker
        installs its handler) ends it with -15; one that lands while it waits for its first
        partition assignment (``consumer.start()``) is not seen until the assignment comes.
        Either way the process had taken no work.
        """
        return [(self._wait(p, 30.0), "polling" in log.read_text(errors="replace")) for p, log in self.retiring]

    @staticmethod
    def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def current_log(self, i: int) -> Path:
        return self.log_dir / f"worker{i}.{self.starts[i]}.log"

    def all_polling(self) -> bool:
        """Every occupied slot has a live process that has joined and started polling."""
        return all(
            p is None or (p.poll() is None and "polling" in self.current_log(i).read_text(errors="replace"))
            for i, p in enumerate(self.procs)
        )

    def count_log(self, pattern: str) -> int:
        """Lines matching ``pattern`` (a regex) across every worker log written so far."""
        rx = re.compile(pattern)
        return sum(len(rx.findall(f.read_text(errors="replace"))) for f in self.log_dir.glob("worker*.log"))

    def count_current_logs(self, pattern: str) -> list[int]:
        """Per occupied slot: lines matching ``pattern`` in its current process's log."""
        rx = re.compile(pattern)
        return [
            len(rx.findall(self.current_log(i).read_text(errors="replace")))
            for i, p in enumerate(self.procs)
            if p is not None
        ]

    def diagnosis(self, lines: int = 15) -> str:
        """Per slot: alive, polling, and the last ``lines`` log lines that are not verdicts.

        What a failed wait prints, so a stall seen only on another machine (CI) shows whether
        the workers were joining, polling or erroring without a rerun.
        """
        out = []
        for i, p in enumerate(self.procs):
            if p is None:
                out.append(f"--- slot {i}: empty")
                continue
            text = self.current_log(i).read_text(errors="replace").splitlines()
            tail = [ln for ln in text if " verdict=" not in ln][-lines:]
            out.append(
                f"--- slot {i} ({self.current_log(i).name}): exit={p.poll()} "
                f"polling={any('polling' in ln for ln in text)}\n" + "\n".join(tail)
            )
        return "\n".join(out)

    TRANSIENT = r"transient \w+|sweep skipped"

    def transient_errors(self) -> int:
        """Transient Redis/Kafka errors the workers logged and retried (or skipped a sweep for)."""
        return self.count_log(self.TRANSIENT)


# --------------------------------------------------------------------------- verdict tail
class VerdictTail:
    """Reads the verdicts topic from the beginning in the background; survives broker restarts."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.records: list[Any] = []
        self.groups: set[str] = set()
        self.read_errors = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def __aenter__(self) -> VerdictTail:
        self._task = asyncio.create_task(self._run())
        await eventually(
            lambda: self._ready.is_set() or self._task.done(), timeout_s=30, what="the verdict tail to start"
        )
        if self._task.done():
            self._task.result()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        topic = self.cfg.topics.verdicts
        consumer = make_consumer(self.cfg.kafka, group_id=None)
        await consumer.start()
        try:
            await assign_from_start(consumer, topic)
            self._ready.set()
            while not self._stop.is_set():
                try:
                    batch = await consumer.getmany(timeout_ms=100)
                except KafkaError:  # broker restarting: the consumer reconnects by itself
                    self.read_errors += 1
                    await asyncio.sleep(POLL_S)
                    continue
                for records in batch.values():
                    for r in records:
                        self.records.append(r)
                        self.groups.add(r.key.decode())
        finally:
            await consumer.stop()

    def done(self, groups: set[str]) -> int:
        return len(self.groups & groups)

    def created_times(self) -> list[float]:
        """Producer timestamps (wall clock, s) of the verdict records read so far, sorted."""
        return sorted(r.timestamp / 1000 for r in self.records)

    def first_created_after(self, wall: float) -> float | None:
        """Seconds from ``wall`` (``time.time()``) to the first verdict *produced* after it."""
        return next((t - wall for t in self.created_times() if t > wall), None)

    def max_gap(self, wall_start: float, wall_end: float) -> float:
        """Longest time in which no verdict was produced, between two wall-clock instants."""
        times = [wall_start, *(t for t in self.created_times() if wall_start < t < wall_end), wall_end]
        return max(b - a for a, b in itertools.pairwise(times))


# --------------------------------------------------------------------------- load
def by_group(messages: Sequence[TrajectoryMessage]) -> dict[str, list[TrajectoryMessage]]:
    out: dict[str, list[TrajectoryMessage]] = {}
    for m in messages:
        out.setdefault(m.group_id, []).append(m)
    return out


class PacedLoad:
    """Publishes groups in waves of ``wave`` groups, keeping at most ``max_in_flight`` groups
    published without a verdict; a wave whose delivery fails is published again (duplicates
    are the ledger's job to absorb).

    With ``enough`` set, publishing ends early once the event is set (the scenario's faults
    are over), so the load lasts as long as the faults do; the expectation is then the set
    of groups actually published (:attr:`expected`).
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        messages: Sequence[TrajectoryMessage],
        tail: VerdictTail,
        *,
        wave: int = 20,
        max_in_flight: int = 60,
        timeout_s: float = 150,
        enough: asyncio.Event | None = None,
        max_groups_per_s: float | None = None,
    ) -> None:
        self.cfg, self.tail, self.enough = cfg, tail, enough
        # An upper bound on the load, so a fast machine does not run through the pool of
        # groups before a long scenario's faults are over.
        self.min_wave_interval_s = 0.0 if not max_groups_per_s else wave / max_groups_per_s
        self.groups = by_group(messages)
        self.order = list(self.groups)
        self.wave, self.max_in_flight, self.timeout_s = wave, max_in_flight, timeout_s
        self.published: list[str] = []
        self.records_sent = 0
        self.publish_retries = 0
        self.finished_at: float | None = None

    @property
    def expected(self) -> set[str]:
        """Every group published (all of them once :meth:`run` finished without ``enough``)."""
        return set(self.published)

    def in_flight_groups(self) -> set[str]:
        return set(self.published) - self.tail.groups

    def in_flight_messages(self) -> int:
        return sum(len(self.groups[g]) for g in self.in_flight_groups())

    def trajectories(self) -> int:
        """Trajectories published (once each, not counting re-published waves)."""
        return sum(1 for g in self.published for m in self.groups[g] if isinstance(m, ReadyTrajectory))

    def _enough(self) -> bool:
        return self.enough is not None and self.enough.is_set()

    async def finish(self, publisher: asyncio.Task[None], tail: VerdictTail) -> set[str]:
        """End the load (``enough``), wait for the publisher and for every published group's
        verdict; return the expected groups. Shared end of every paced-load scenario."""
        if self.enough is not None:
            self.enough.set()
        await publisher
        expected = self.expected
        await eventually(lambda: tail.done(expected) == len(expected), timeout_s=120, what="every group's verdict")
        return expected

    async def run(self) -> None:
        pub: TrajectoryPublisher | None = None
        next_wave = time.monotonic()
        try:
            for i in range(0, len(self.order), self.wave):
                if (delay := next_wave - time.monotonic()) > 0:
                    await asyncio.sleep(delay)  # pacing the load generator, not a sync point
                next_wave = time.monotonic() + self.min_wave_interval_s
                chunk = self.order[i : i + self.wave]
                room = self.max_in_flight - len(chunk)  # groups that may still be open when it goes out
                await eventually(
                    lambda room=room: len(self.in_flight_groups()) <= room or self._enough(),
                    timeout_s=self.timeout_s,
                    what=f"room to publish wave {i // self.wave}",
                )
                if self._enough():
                    break
                messages = [m for g in chunk for m in self.groups[g]]
                while True:
                    try:
                        if pub is None:
                            pub = TrajectoryPublisher(self.cfg.kafka, self.cfg.topics)
                            await pub.start()
                        await pub.publish_many(messages)
                        await pub.flush()
                        break
                    except (PublishError, KafkaError, OSError) as exc:
                        self.publish_retries += 1
                        log.warning("wave %d not acknowledged (%r); publishing it again", i // self.wave, exc)
                        if pub is not None:
                            with contextlib.suppress(Exception):
                                await pub.aclose()
                            pub = None
                        await asyncio.sleep(0.2)  # back-off before reconnecting, not a sync point
                self.records_sent += len(messages)
                self.published.extend(chunk)
            self.finished_at = time.monotonic()
        finally:
            if pub is not None:
                with contextlib.suppress(Exception):
                    await pub.aclose()


# --------------------------------------------------------------------------- verdict checks
@dataclass
class VerdictCheck:
    records: int
    keys: int  # distinct (group_id, verdict_version)
    missing: list[str]
    unexpected: list[str]
    multi_version: list[str]
    conflicting: list[tuple[str, int]]
    verdicts: dict[str, GroupVerdict] = field(repr=False)
    statuses: Counter[str] = field(default_factory=Counter)
    # per group: seconds from the decision (stored in Redis) to the first verdict record's
    # timestamp; a verdict whose decider died before publishing waits for a re-publish
    publish_lag_s: dict[str, float] = field(default_factory=dict, repr=False)

    def late(self, threshold_s: float) -> list[str]:
        """Groups whose first verdict record came more than ``threshold_s`` after the decision."""
        return sorted(g for g, lag in self.publish_lag_s.items() if lag > threshold_s)

    @property
    def duplicates(self) -> int:
        """Verdict records the trainer's dedupe drops (redeliveries / re-publishes)."""
        return self.records - self.keys

    def assert_exactly_once(self, context: str = "") -> None:
        assert not self.missing, f"{len(self.missing)} groups lost (no verdict), e.g. {self.missing[:5]}\n{context}"
        assert not self.unexpected, f"verdicts for groups never published: {self.unexpected[:5]}"
        assert not self.multi_version, f"groups with two verdict versions: {self.multi_version[:5]}"
        assert not self.conflicting, (
            f"conflicting duplicate verdicts (same key, different bytes): {self.conflicting[:5]}"
        )


def check_verdicts(records: Sequence[Any], expected: set[str]) -> VerdictCheck:
    by_key: dict[tuple[str, int], set[bytes]] = {}
    verdicts: dict[str, GroupVerdict] = {}
    lag: dict[str, float] = {}
    for r in records:
        v = decode_verdict(r.value, r.headers)
        by_key.setdefault((v.group_id, v.verdict_version), set()).add(r.value)
        verdicts.setdefault(v.group_id, v)
        lag[v.group_id] = min(lag.get(v.group_id, float("inf")), r.timestamp / 1000 - v.decided_at)
    versions = Counter(g for g, _ in by_key)
    groups = set(versions)
    return VerdictCheck(
        records=len(records),
        keys=len(by_key),
        missing=sorted(expected - groups),
        unexpected=sorted(groups - expected),
        multi_version=sorted(g for g, n in versions.items() if n > 1),
        conflicting=sorted(k for k, values in by_key.items() if len(values) > 1),
        verdicts=verdicts,
        statuses=Counter(v.status for v in verdicts.values()),
        publish_lag_s=lag,
    )


def reason_code(verdict: GroupVerdict) -> str:
    return verdict.reason_code


def log_dir(tmp_path: Path) -> Path:
    d = tmp_path / "workers"
    d.mkdir(exist_ok=True)
    return d


# --------------------------------------------------------------------------- service outages
async def outage(
    fault: str,
    *,
    load: PacedLoad,
    down: Callable[[], int | None],
    up: Callable[[], None],
    client_errors: Callable[[], list[int]],
    min_errors_each: int = 1,
    notice_timeout_s: float = 15.0,
) -> dict[str, Any]:
    """Take a service down, keep it down until every client has noticed (each one's logged
    errors grew by ``min_errors_each``; a poll with a deadline), bring it back; return the
    outage's figures (``t_up``, wall clock, is for measuring recovery with :func:`recovery`).
    """
    in_flight = load.in_flight_messages()
    before = client_errors()
    t_down = time.monotonic()
    exit_code = down()
    noticed, _, _ = await poll_until(
        lambda: all(now - was >= min_errors_each for now, was in zip(client_errors(), before)),
        timeout_s=notice_timeout_s,
    )
    up()
    down_s, t_up = time.monotonic() - t_down, time.time()
    return {
        "fault": fault,
        "exit_code": exit_code,
        "in_flight_msgs": in_flight,
        "down_s": round(down_s, 2),
        "clients_noticed": noticed,
        "client_errors_logged": sum(client_errors()) - sum(before),
        "t_up": t_up,
    }


def recovery(events: list[dict[str, Any]], tail: VerdictTail) -> list[dict[str, Any]]:
    """Figures without the time stamps, plus seconds from the service's return to the first
    verdict produced after it."""
    out = []
    for e in events:
        nxt = tail.first_created_after(e["t_up"])
        out.append(
            {**{k: v for k, v in e.items() if k != "t_up"}, "recovery_s": round(nxt, 2) if nxt is not None else None}
        )
    return out
