"""Reading the pipeline's state for ``prm-pipeline status``: Kafka through the
:mod:`infra.kafka` factories, Redis through the ledger's read-only methods.

Each part (Kafka lag and members, the Redis ledger, recent dead letters, recent
verdicts) runs under its own time bound; a part that fails is reported in
``StatusReport.errors`` (a critical problem) instead of failing the whole command.

Offsets: a partition's end is the high watermark of a fetch (a group-less consumer
seeks each partition to the group's committed offset and fetches once), not
``end_offsets`` (wrong on the embedded broker); committed offsets come from the admin
client with the partitions named (the embedded broker cannot list them all at once).

With ``experiment`` (``status --experiment ID``, docs/fleet.md) every part is about that
experiment: the workers' lag on its trajectories topic, its trainer group's
(:attr:`infra.config.TrainerConfig.consumer_group`) on its verdicts topic, its verdicts,
the dead letters that came from its topic, the ledger's groups of its scope; and, from
the workers' ``/metrics`` URLs given, its records, verdicts, in-flight records and slots
(:mod:`prm_pipeline.status.worker_metrics`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiokafka.structs import TopicPartition

from infra.config import PipelineConfig
from infra.experiments import DEFAULT_EXPERIMENT, split_scoped, trajectories_topic, verdicts_topic
from infra.kafka import TopicMissing, make_admin, make_consumer, partitions_of
from infra.reasons import metric_label
from infra.schema import SchemaError, decode_verdict
from prm_pipeline.status.report import (
    DeadLetterSummary,
    GroupLag,
    LedgerSummary,
    PartitionLag,
    RedisNode,
    StatusReport,
    VerdictSummary,
    WorkerBeat,
    WorkersSummary,
    assess,
    percentile,
)
from prm_pipeline.verdict_dump import TOPIC_WAIT_S

MAX_DEAD_LETTERS = 5_000  # read at most this many dead letters per status
MAX_VERDICTS = 1_000  # and this many recent verdicts (they carry token arrays)
LEDGER_SAMPLE = 1_000  # unfinished groups whose state is read


@dataclass
class LagSample:
    """One reading of the groups' offsets and members at ``at`` (epoch seconds)."""

    at: float
    # (role, group) -> {partition: (end, committed or None, first offset)}
    offsets: dict[tuple[str, str], dict[int, tuple[int, int | None, int]]]
    members: dict[str, tuple[int | None, str]]  # group -> (members, state)


def _small_consumer(cfg: PipelineConfig) -> Any:
    """A group-less consumer that fetches little: status only needs watermarks and a few records."""
    return make_consumer(
        cfg.kafka,
        group_id=None,
        fetch_max_bytes=4 * 1_048_576,
        max_partition_fetch_bytes=max(65_536, cfg.kafka.max_message_bytes),
    )


def _roles(cfg: PipelineConfig, experiment: str | None = None) -> list[tuple[str, str, str]]:
    """``(role, consumer group, topic)`` of the workers and the trainer (of ``experiment``'s topics)."""
    exp = experiment or DEFAULT_EXPERIMENT
    trainer = msgspec.structs.replace(cfg.trainer, experiment=exp).consumer_group
    return [
        ("workers", cfg.worker.group_id, trajectories_topic(cfg.topics.trajectories, exp)),
        ("trainer", trainer, verdicts_topic(cfg.topics.verdicts, exp)),
    ]


async def _members(admin: Any, groups: list[str]) -> dict[str, tuple[int | None, str]]:
    """``group -> (live members, state)`` from DescribeGroups, one group per request (the
    embedded broker garbles the second group of a multi-group answer)."""
    out: dict[str, tuple[int | None, str]] = {}
    for group in groups:
        out[group] = (None, "unknown")
        for response in await admin.describe_consumer_groups([group]):
            for entry in response.groups:
                error_code, name, state, members = entry[0], entry[1], entry[2], entry[5]
                if name == group:
                    out[group] = (None, f"error {error_code}") if error_code else (len(members), state or "unknown")
    return out


async def _watermarks(
    cfg: PipelineConfig, start: dict[TopicPartition, int], timeout_s: float
) -> dict[TopicPartition, int]:
    """The high watermark of every partition in ``start``, from one fetch at that offset."""
    consumer = _small_consumer(cfg)
    await consumer.start()
    try:
        consumer.assign(list(start))
        for tp, offset in start.items():
            consumer.seek(tp, offset)
        ends: dict[TopicPartition, int] = {}
        deadline = time.monotonic() + timeout_s
        while len(ends) < len(start):
            if time.monotonic() > deadline:
                missing = sorted(f"{tp.topic}:{tp.partition}" for tp in start if tp not in ends)
                raise TimeoutError(f"no high watermark for {missing} within {timeout_s:g}s")
            await consumer.getmany(timeout_ms=200, max_records=1)
            for tp in start:
                high = consumer.highwater(tp)
                if high is not None:
                    ends[tp] = high
        return ends
    finally:
        await consumer.stop()


async def sample_lag(cfg: PipelineConfig, *, timeout_s: float = 10.0, experiment: str | None = None) -> LagSample:
    """Committed offsets, ends and members of the workers' and the trainer's groups."""
    admin = make_admin(cfg.kafka)
    await admin.start()
    probe = _small_consumer(cfg)
    await probe.start()
    try:
        roles = _roles(cfg, experiment)
        members = await _members(admin, [g for _, g, _ in roles])
        committed: dict[tuple[str, str], dict[TopicPartition, tuple[int | None, int]]] = {}
        start: dict[TopicPartition, int] = {}
        for role, group, topic in roles:
            tps = await partitions_of(probe, topic, timeout_s=min(timeout_s, TOPIC_WAIT_S))
            firsts = await probe.beginning_offsets(tps)
            offsets = await admin.list_consumer_group_offsets(group, partitions=tps)
            per: dict[TopicPartition, tuple[int | None, int]] = {}
            for tp in tps:
                meta = offsets.get(tp)
                done = meta.offset if meta is not None and meta.offset >= 0 else None
                per[tp] = (done, firsts.get(tp, 0))
                start[tp] = max(start.get(tp, 0), done if done is not None else firsts.get(tp, 0))
            committed[(role, group)] = per
    finally:
        await probe.stop()
        await admin.close()
    ends = await _watermarks(cfg, start, timeout_s)
    offsets_out: dict[tuple[str, str], dict[int, tuple[int, int | None, int]]] = {}
    for key, per in committed.items():
        offsets_out[key] = {tp.partition: (ends[tp], done, first) for tp, (done, first) in per.items()}
    return LagSample(time.time(), offsets_out, members)


def _lag(end: int, committed: int | None, first: int) -> int:
    """Records the group has yet to commit; without a commit it reads from the first offset."""
    return max(0, end - (committed if committed is not None else first))


def lag_report(
    cfg: PipelineConfig, now: LagSample, before: LagSample | None, experiment: str | None = None
) -> list[GroupLag]:
    """Per-group lag from ``now``; growth and produced records against ``before``."""
    out = []
    for role, group, topic in _roles(cfg, experiment):
        per = now.offsets.get((role, group), {})
        parts = [PartitionLag(p, end, c, _lag(end, c, first)) for p, (end, c, first) in sorted(per.items())]
        members, state = now.members.get(group, (None, "unknown"))
        g = GroupLag(role, group, topic, parts, sum(p.lag for p in parts), members, state)
        prev = before.offsets.get((role, group)) if before is not None else None
        if prev is not None:
            old_total = sum(_lag(*offsets) for offsets in prev.values())
            g.growth = g.total - old_total
            g.produced = sum(end - prev[p][0] for p, (end, _, _) in per.items() if p in prev)
            g.window_s = now.at - before.at  # type: ignore[union-attr]
        out.append(g)
    return out


async def ledger_summary(
    cfg: PipelineConfig, *, now_ms: int | None = None, experiment: str | None = None
) -> tuple[LedgerSummary, WorkersSummary]:
    """The ledger's unfinished groups and Redis memory, and the workers' heartbeats.

    With ``experiment``, only that experiment's groups (by their scoped ids) of the
    sampled ones count; ``indexed`` stays the whole ledger's."""
    from scoring_workers.heartbeat import ALIVE_S
    from scoring_workers.ledger import LedgerView

    ledger = LedgerView.from_config(cfg.redis)
    try:
        total, groups = await ledger.unfinished_groups(LEDGER_SAMPLE)
        memory = await ledger.memory()
        commands = await ledger.command_calls()
        beats = await ledger.heartbeats()
    finally:
        await ledger.aclose()
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    ages = sorted((WorkerBeat(w, max(0.0, (now_ms - ms) / 1000)) for w, ms in beats), key=lambda b: b.age_s)
    workers = WorkersSummary(ALIVE_S, [b for b in ages if b.age_s < ALIVE_S], [b for b in ages if b.age_s >= ALIVE_S])
    if experiment is not None:
        groups = [g for g in groups if split_scoped(g.group_id)[0] == experiment]
    open_groups = [g for g in groups if g.status == "open"]
    decided = [g for g in groups if g.status == "decided"]
    summary = LedgerSummary(
        indexed=total,
        sampled=len(groups),
        open=len(open_groups),
        decided=len(decided),
        gone=sum(g.status == "gone" for g in groups),
        group_timeout_s=cfg.worker.group_timeout_s,
        memory=[RedisNode(n, used, mx) for n, used, mx in memory],
        redis_commands=commands,
    )
    if open_groups:
        oldest = min(open_groups, key=lambda g: g.first_seen_ms or now_ms)
        summary.oldest_open_group = oldest.group_id
        summary.oldest_open_age_s = max(0.0, (now_ms - (oldest.first_seen_ms or now_ms)) / 1000)
        if oldest.first_seen_ms and oldest.deadline_ms > oldest.first_seen_ms:
            summary.oldest_open_timeout_s = (oldest.deadline_ms - oldest.first_seen_ms) / 1000
    if decided:
        summary.oldest_decided_age_s = max(0.0, (now_ms - min(g.decided_at_ms or now_ms for g in decided)) / 1000)
    return summary, workers


async def _read_since(
    cfg: PipelineConfig, topic: str, since_ms: int, cap: int, timeout_s: float
) -> tuple[list[Any], bool]:
    """Records of ``topic`` timestamped at/after ``since_ms`` up to the ends seen at the first
    fetch, at most ``cap`` (then True: truncated). Newest records are preferred: when a
    partition holds more than its share of ``cap``, its oldest are skipped."""
    consumer = _small_consumer(cfg)
    await consumer.start()
    try:
        tps = await partitions_of(consumer, topic, timeout_s=min(timeout_s, TOPIC_WAIT_S))
        found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
        # no record at/after since_ms: None (the embedded broker answers timestamp -1 instead)
        starts = {tp: hit.offset for tp, hit in found.items() if hit is not None and hit.timestamp >= 0}
        if not starts:
            return [], False
        ends = await _watermarks(cfg, starts, timeout_s)
        share = max(1, cap // len(starts))
        truncated = False
        for tp, first in starts.items():
            if ends[tp] - first > share:
                starts[tp], truncated = ends[tp] - share, True
        todo = {tp for tp in starts if starts[tp] < ends[tp]}
        consumer.assign(list(todo))
        for tp in todo:
            consumer.seek(tp, starts[tp])
        records: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200, max_records=500)
            for tp, rs in batch.items():
                records += [r for r in rs if r.offset < ends[tp] and r.timestamp >= since_ms]
                if rs and rs[-1].offset + 1 >= ends[tp]:
                    todo.discard(tp)
        return records, truncated or bool(todo)
    finally:
        await consumer.stop()


async def dead_letter_summary(
    cfg: PipelineConfig, window_s: float, timeout_s: float, experiment: str | None = None
) -> DeadLetterSummary:
    """Dead letters of the last ``window_s`` by error class (with ``experiment``: those that
    came from its trajectories topic)."""
    since_ms = int((time.time() - window_s) * 1000)
    records, truncated = await _read_since(cfg, cfg.topics.dead_letters, since_ms, MAX_DEAD_LETTERS, timeout_s)
    source = trajectories_topic(cfg.topics.trajectories, experiment).encode() if experiment is not None else None
    reasons: Counter[str] = Counter()
    count = 0
    for r in records:
        headers = {k: v for k, v in (r.headers or ())}
        if source is not None and headers.get("prm-dl-source-topic") != source:
            continue
        count += 1
        reasons[(headers.get("prm-dl-error-class") or b"unknown").decode(errors="replace")] += 1
    return DeadLetterSummary(window_s, count, reasons.most_common(5), truncated)


async def verdict_summary(
    cfg: PipelineConfig, window_s: float, timeout_s: float, experiment: str | None = None
) -> VerdictSummary:
    """Rate, statuses and latency of the verdicts published in the last ``window_s``.

    Latency per member: its trajectory's ``created_at`` to the verdict record's timestamp;
    stages as the workers' ``prm_worker_stage_seconds`` (docs/architecture.md)."""
    since_ms = int((time.time() - window_s) * 1000)
    topic = verdicts_topic(cfg.topics.verdicts, experiment or DEFAULT_EXPERIMENT)
    records, truncated = await _read_since(cfg, topic, since_ms, MAX_VERDICTS, timeout_s)
    statuses: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    latency: list[float] = []
    stages: dict[str, list[float]] = {s: [] for s in ("queue", "score", "park", "wait", "send")}
    for r in records:
        try:
            v = decode_verdict(r.value, r.headers)
        except SchemaError:
            statuses["undecodable"] += 1
            continue
        statuses[v.status] += 1
        if v.status != "accepted":
            reasons[metric_label(v.status, v.reason_code)] += 1  # the registered code, never the free text
        sent = r.timestamp / 1000
        if v.decided_at:
            stages["send"].append(max(0.0, sent - v.decided_at))
        for m in v.sessions:
            if m.created_at:
                latency.append(max(0.0, sent - m.created_at))
                if m.consumed_at:
                    stages["queue"].append(max(0.0, m.consumed_at - m.created_at))
            if m.scored_at and m.consumed_at:
                stages["score"].append(max(0.0, m.scored_at - m.consumed_at))
                if m.parked_at:
                    stages["park"].append(max(0.0, m.parked_at - m.scored_at))
            if m.parked_at and v.decided_at:
                stages["wait"].append(max(0.0, v.decided_at - m.parked_at))
    span = window_s
    if truncated and records:
        span = max(1e-3, time.time() - min(r.timestamp for r in records) / 1000)
    return VerdictSummary(
        window_s=span,
        count=len(records),
        per_second=len(records) / span,
        by_status=dict(statuses),
        top_reasons=reasons.most_common(5),
        latency_p50_s=percentile(latency, 50),
        latency_p99_s=percentile(latency, 99),
        stage_p50_s={s: p for s, vals in stages.items() if (p := percentile(vals, 50)) is not None},
    )


async def _bounded(report: StatusReport, part: str, coro: Any, timeout_s: float) -> Any:
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except TimeoutError:
        report.errors[part] = f"no answer within {timeout_s:g}s"
    except TopicMissing as exc:  # Kafka answered: the topic is not there (not "unreachable")
        report.errors["topics"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure of one part is reported, the others still run
        report.errors[part] = f"{type(exc).__name__}: {exc}"[:300]
    return None


async def collect(
    cfg: PipelineConfig,
    *,
    previous: LagSample | None = None,
    sample_s: float = 2.0,
    dead_letter_window_s: float = 600.0,
    verdict_window_s: float = 60.0,
    timeout_s: float = 10.0,
    experiment: str | None = None,
    worker_metrics: Sequence[str] = (),
) -> tuple[StatusReport, LagSample | None]:
    """One status report, and the lag sample to compare the next one with.

    Without ``previous`` the lag is sampled twice, ``sample_s`` apart, so that a growing
    lag shows in a single run; with it (``--watch``) once, against ``previous``.
    ``experiment`` scopes every part (module docstring); ``worker_metrics`` are the
    workers' ``/metrics`` URLs its fleet share is read from (needs ``experiment``).
    """
    report = StatusReport(at=time.time(), experiment=experiment)
    ledger_task = asyncio.ensure_future(
        _bounded(report, "redis", ledger_summary(cfg, experiment=experiment), timeout_s)
    )
    fleet_task = None
    if experiment is not None and worker_metrics:
        from prm_pipeline.status.worker_metrics import scrape

        fleet_task = asyncio.ensure_future(scrape(worker_metrics, experiment, timeout_s=timeout_s))
    first = previous
    if first is None:
        first = await _bounded(
            report, "kafka", sample_lag(cfg, timeout_s=timeout_s, experiment=experiment), timeout_s * 2
        )
    latest = None
    if first is not None:
        # The other Kafka reads run while the lag sample waits out its window: a report takes
        # about --sample seconds plus its slowest read, not the sum of all of them.
        dead_task = asyncio.ensure_future(
            _bounded(
                report,
                "dead_letters",
                dead_letter_summary(cfg, dead_letter_window_s, timeout_s, experiment),
                timeout_s * 2,
            )
        )
        verdict_task = asyncio.ensure_future(
            _bounded(report, "verdicts", verdict_summary(cfg, verdict_window_s, timeout_s, experiment), timeout_s * 2)
        )
        if previous is None:
            await asyncio.sleep(sample_s)
        latest = await _bounded(
            report, "kafka", sample_lag(cfg, timeout_s=timeout_s, experiment=experiment), timeout_s * 2
        )
        dead_letters, verdicts = await asyncio.gather(dead_task, verdict_task)
        if latest is not None:
            report.lags = lag_report(cfg, latest, first if first is not latest else None, experiment)
            report.dead_letters, report.verdicts = dead_letters, verdicts
        else:  # Kafka stopped answering meanwhile: one problem, not one per part
            for part in ("dead_letters", "verdicts"):
                report.errors.pop(part, None)
    if fleet_task is not None:
        report.fleet = await fleet_task  # each endpoint bounded by timeout_s; failures are listed, not raised
    redis_part = await ledger_task
    if redis_part is not None:
        report.ledger, report.workers = redis_part
    report.problems = assess(report)
    return report, latest
