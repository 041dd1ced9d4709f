"""What ``prm-pipeline status`` reports, and when the pipeline counts as unhealthy.

Pure data and rules, no I/O: :mod:`prm_pipeline.status.collect` fills a
:class:`StatusReport` from Kafka and Redis, :func:`assess` turns it into problems. Kept
apart so the rules (the exit code scripts and probes rely on) are unit-tested on their own.

Critical problems (exit code 1): Kafka or Redis unreachable, a topic it reads missing
(``topic_missing``: Kafka answered), no live worker (no Redis
heartbeat younger than ``ALIVE_S``; without Redis, no consumer-group member), a consumer
group's lag growing over the sampling window, the oldest open group past
:data:`NEAR_TIMEOUT_SHARE` of ``worker.group_timeout_s``. Warnings (shown, exit code 0):
workers that stopped beating without leaving, dead letters in the window, decided groups whose verdict is overdue,
Redis memory near
``maxmemory``, a trainer group that is not consuming; with ``--experiment``, worker metrics
endpoints that did not answer and an experiment no worker exports series for.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

NEAR_TIMEOUT_SHARE = 0.8  # the oldest open group past this share of its timeout is critical
LAG_SLACK = 10  # lag may rise this many records (or 10% of what was produced) in a window without alarm
REDIS_MEMORY_SHARE = 0.8  # used / maxmemory above this: warning
DECIDED_OVERDUE_S = 30.0  # a decided group still waiting for its verdict after this: warning

Severity = Literal["critical", "warning"]


@dataclass
class PartitionLag:
    partition: int
    end: int  # the partition's high watermark
    committed: int | None  # the group's committed offset; None: nothing committed (reads from the start)
    lag: int


@dataclass
class GroupLag:
    """One consumer group on one topic: lag per partition and in total, members, trend."""

    role: str  # "workers" or "trainer"
    group: str
    topic: str
    partitions: list[PartitionLag]
    total: int
    members: int | None  # live members (None: the broker could not say)
    state: str  # the broker's group state (Stable, Empty, PreparingRebalance, Dead, ...)
    growth: int | None = None  # change of ``total`` over the window (None: one sample only)
    produced: int | None = None  # records appended to the topic during the window
    window_s: float = 0.0

    @property
    def active(self) -> bool:
        """The group exists: it has members or has committed something."""
        return bool(self.members) or any(p.committed is not None for p in self.partitions)

    @property
    def growing(self) -> bool:
        if self.growth is None or self.produced is None:
            return False
        return self.growth > max(LAG_SLACK, 0.1 * self.produced)


@dataclass
class RedisNode:
    node: str
    used_bytes: int
    max_bytes: int  # 0: no maxmemory


@dataclass
class WorkerBeat:
    worker_id: str
    age_s: float  # since its last heartbeat in Redis


@dataclass
class WorkersSummary:
    """Workers by their Redis heartbeat (scoring_workers/heartbeat.py): ``alive`` beat within
    ``alive_s``; ``silent`` stopped beating without leaving (killed, hung, cut off from Redis)."""

    alive_s: float
    alive: list[WorkerBeat]
    silent: list[WorkerBeat]


@dataclass
class LedgerSummary:
    """The unfinished groups of the Redis ledger (``sampled`` of ``indexed`` were read)."""

    indexed: int
    sampled: int
    open: int
    decided: int  # decided, verdict not yet published
    gone: int  # listed in the index but finished/expired since
    group_timeout_s: float
    oldest_open_group: str | None = None
    oldest_open_age_s: float | None = None
    oldest_open_timeout_s: float | None = None  # the timeout that group was parked with (deadline - first seen)
    oldest_decided_age_s: float | None = None
    memory: list[RedisNode] = field(default_factory=list)
    redis_commands: dict[str, int] = field(default_factory=dict)  # calls per command since Redis started


@dataclass
class DeadLetterSummary:
    window_s: float
    count: int
    top: list[tuple[str, int]]  # (error class, count), most frequent first
    truncated: bool = False  # stopped at the read cap: count is a lower bound


@dataclass
class VerdictSummary:
    """The verdicts published in the last ``window_s`` (or the most recent ``count`` of them)."""

    window_s: float
    count: int
    per_second: float
    by_status: dict[str, int]
    top_reasons: list[tuple[str, int]]  # reason codes of rejected/discarded verdicts
    latency_p50_s: float | None  # trajectory created -> verdict record, per member
    latency_p99_s: float | None
    stage_p50_s: dict[str, float]  # queue / score / park / wait / send


@dataclass
class ExperimentSummary:
    """One experiment's share of the fleet (``status --experiment``), summed over the workers'
    ``/metrics`` read (:mod:`prm_pipeline.status.worker_metrics`)."""

    experiment: str
    sources: int = 0  # worker endpoints read
    present: bool = False  # some worker exported a series of this experiment
    records: dict[str, float] = field(default_factory=dict)  # kind -> records consumed
    verdicts: dict[str, float] = field(default_factory=dict)  # status -> verdicts published
    in_flight: float | None = None  # records being scored now
    slots: float | None = None  # in-flight slots its share gives it
    unreachable: list[str] = field(default_factory=list)  # "url: why" of endpoints that did not answer


@dataclass
class Problem:
    severity: Severity
    check: str  # stable name: kafka_unreachable, no_live_worker, lag_growing, group_near_timeout, ...
    message: str


@dataclass
class StatusReport:
    at: float  # epoch seconds of the collection
    lags: list[GroupLag] = field(default_factory=list)
    ledger: LedgerSummary | None = None
    workers: WorkersSummary | None = None
    dead_letters: DeadLetterSummary | None = None
    verdicts: VerdictSummary | None = None
    experiment: str | None = None  # status --experiment: the report is about this experiment's topics and groups
    fleet: ExperimentSummary | None = None  # its series from the workers' /metrics (--worker-metrics)
    errors: dict[str, str] = field(default_factory=dict)  # part ("kafka", "redis", ...) -> why it could not be read
    problems: list[Problem] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not any(p.severity == "critical" for p in self.problems)

    def group(self, role: str) -> GroupLag | None:
        return next((g for g in self.lags if g.role == role), None)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["healthy"] = self.healthy
        return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def assess(report: StatusReport) -> list[Problem]:
    """The problems ``report`` shows, critical first (see the module docstring)."""
    problems: list[Problem] = []
    for part, why in report.errors.items():
        if part == "topics":  # Kafka answered; a topic it reads is not there
            problems.append(Problem("critical", "topic_missing", why))
        else:
            problems.append(Problem("critical", f"{part}_unreachable", f"{part}: {why}"))
    beats, group = report.workers, report.group("workers")
    if beats is not None and not beats.alive:
        silent = ", ".join(f"{w.worker_id} silent for {w.age_s:.0f}s" for w in beats.silent[:5])
        problems.append(
            Problem(
                "critical",
                "no_live_worker",
                f"no worker heartbeat within {beats.alive_s:g}s{' (' + silent + ')' if silent else ''}",
            )
        )
    elif beats is None and group is not None and group.members == 0:
        problems.append(
            Problem(
                "critical", "no_live_worker", f"consumer group {group.group} has no live member (state {group.state})"
            )
        )
    if beats is not None and beats.alive and beats.silent:
        problems.append(
            Problem(
                "warning",
                "worker_silent",
                "stopped beating without leaving: "
                + ", ".join(f"{w.worker_id} ({w.age_s:.0f}s ago)" for w in beats.silent[:5]),
            )
        )
    for g in report.lags:
        if g.growing and (g.role == "workers" or g.active):
            problems.append(
                Problem(
                    "critical",
                    "lag_growing",
                    f"{g.role} lag on {g.topic} grew by {g.growth} to {g.total} in {g.window_s:.0f}s "
                    f"({g.produced} records produced)",
                )
            )
    ledger = report.ledger
    if ledger is not None and ledger.oldest_open_age_s is not None:
        timeout = ledger.oldest_open_timeout_s or ledger.group_timeout_s
        share = ledger.oldest_open_age_s / timeout
        if share >= NEAR_TIMEOUT_SHARE:
            problems.append(
                Problem(
                    "critical",
                    "group_near_timeout",
                    f"group {ledger.oldest_open_group} open for {ledger.oldest_open_age_s:.1f}s, {share:.0%} of its "
                    f"{timeout:g}s timeout (worker.group_timeout_s)",
                )
            )
    if ledger is not None and (ledger.oldest_decided_age_s or 0) >= DECIDED_OVERDUE_S:
        problems.append(
            Problem(
                "warning",
                "verdict_overdue",
                f"{ledger.decided} decided group(s) without a published verdict, oldest decided "
                f"{ledger.oldest_decided_age_s:.0f}s ago",
            )
        )
    for node in ledger.memory if ledger is not None else []:
        if node.max_bytes and node.used_bytes >= REDIS_MEMORY_SHARE * node.max_bytes:
            problems.append(
                Problem(
                    "warning",
                    "redis_memory",
                    f"Redis {node.node} uses {node.used_bytes / node.max_bytes:.0%} of maxmemory",
                )
            )
    dl = report.dead_letters
    if dl is not None and dl.count:
        top = ", ".join(f"{reason} x{n}" for reason, n in dl.top[:3])
        problems.append(
            Problem(
                "warning",
                "dead_letters",
                f"{dl.count}{'+' if dl.truncated else ''} dead letter(s) in the last {dl.window_s:.0f}s: {top}",
            )
        )
    fleet = report.fleet
    if fleet is not None and fleet.unreachable:
        problems.append(
            Problem(
                "warning",
                "worker_metrics_unreachable",
                f"{len(fleet.unreachable)} worker metrics endpoint(s) did not answer: "
                + "; ".join(fleet.unreachable[:3]),
            )
        )
    if fleet is not None and fleet.sources and not fleet.present:
        problems.append(
            Problem(
                "warning",
                "experiment_not_served",
                f"none of the {fleet.sources} worker(s) read exports a series of experiment "
                f"{fleet.experiment!r} (not registered, removed, or workers without per-experiment "
                "metrics)",
            )
        )
    trainer = report.group("trainer")
    if trainer is not None and not trainer.active and trainer.total:
        problems.append(
            Problem(
                "warning",
                "trainer_idle",
                f"trainer group {trainer.group} has no member and no commit; {trainer.total} "
                f"verdicts wait on {trainer.topic}",
            )
        )
    return sorted(problems, key=lambda p: p.severity != "critical")
