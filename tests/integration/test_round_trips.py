"""Round trips the worker spends per trajectory: no probe for records published after it
took the partition over, and the group's finish riding along after the verdict."""

from __future__ import annotations

import uuid

import msgspec
import pytest
from aiokafka.structs import TopicPartition

from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from scoring_workers.ledger import GroupLedger
from tests.integration.harness import isolated_config, read_topic, running_worker, wait_for_verdicts
from tests.polling import eventually

pytestmark = pytest.mark.integration

SCORER = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer")


def _config(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    name = f"rt-{uuid.uuid4().hex[:8]}"
    return isolated_config(name, kafka_bootstrap, redis_url, scorers=[SCORER], partitions=1)


def _count(worker, name: str) -> float:
    return worker.telemetry.snapshot().get(name, 0.0)


async def _marked(worker, cfg: PipelineConfig) -> None:
    tp = TopicPartition(cfg.topics.trajectories, 0)

    async def known() -> bool:
        return worker._marks.mark(tp) is not None

    await eventually(known, timeout_s=30, what="the worker to learn the partition's mark")


async def test_records_past_the_mark_skip_the_probe_and_duplicates_are_still_acknowledged(
    kafka_bootstrap, redis_url
) -> None:
    cfg = _config(kafka_bootstrap, redis_url)
    gid = f"g-{uuid.uuid4().hex[:6]}"
    a, b = make_group(gid, 2, turns=1, output_tokens=8)
    ledger = GroupLedger.from_config(cfg.redis)
    try:
        async with running_worker(cfg, "w-rt") as worker, TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await _marked(worker, cfg)
            await pub.publish_many([a])

            async def parked() -> bool:
                return a.trajectory_id in await ledger.view.parked_blobs(gid)

            await eventually(parked, timeout_s=30, what="member a to be parked")
            await pub.publish_many([a])  # re-sent by its publisher: scored again, acknowledged at park

            async def deduplicated(n: int) -> bool:
                return _count(worker, "prm_worker_deduplicated_total") >= n

            await eventually(
                lambda: deduplicated(1), timeout_s=30, what="the re-sent member to be acknowledged as a duplicate"
            )
            await pub.publish_many([b])
            (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid]) if v.group_id == gid]
            assert sorted(s.trajectory_id for s in verdict.sessions) == sorted([a.trajectory_id, b.trajectory_id])

            async def finished() -> bool:
                return not await ledger.redis.exists(ledger.group_key(gid))

            await eventually(finished, timeout_s=30, what="the group to be finished")
            await pub.publish_many([a])  # re-sent after the group finished: its park finds it done
            await eventually(lambda: deduplicated(2), timeout_s=30, what="the late member to be acknowledged")
            assert _count(worker, "prm_worker_probes_total{kind=probed}") == 0
            assert _count(worker, "prm_worker_probes_total{kind=skipped}") == 4
        assert await ledger.probe_many([(gid, a.trajectory_id)]) == ["done"]
        verdicts = await read_topic(cfg, cfg.topics.verdicts)
        assert [r.key.decode() for r in verdicts] == [gid]  # one verdict, no second one for the duplicates
    finally:
        await ledger.aclose()


async def test_a_record_redelivered_after_a_restart_is_probed_and_not_scored_again(kafka_bootstrap, redis_url) -> None:
    """A previous owner parked a member and stopped before committing it: the next owner
    reads it below its mark, probes it and acknowledges it without scoring; a member
    published afterwards is scored without a probe and completes the group."""
    cfg = _config(kafka_bootstrap, redis_url)
    gid = f"g-{uuid.uuid4().hex[:6]}"
    a, b = make_group(gid, 2, turns=1, output_tokens=8)
    ledger = GroupLedger.from_config(cfg.redis)
    try:
        async with running_worker(cfg, "w-first") as first, TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many([a])

            async def parked() -> bool:
                return bool(await ledger.view.parked_blobs(gid))

            await eventually(parked, timeout_s=30, what="member a to be parked")
            assert _count(first, "prm_worker_scored_total") == 1
        # the first owner's commit never happened (it died before): to the next owner the
        # record is uncommitted, as it is to a consumer group that has committed nothing
        cfg = msgspec.structs.replace(
            cfg, worker=msgspec.structs.replace(cfg.worker, group_id=f"{cfg.worker.group_id}-next")
        )
        async with running_worker(cfg, "w-second") as second, TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:

            async def acknowledged() -> bool:
                return _count(second, "prm_worker_deduplicated_total") >= 1

            await eventually(acknowledged, timeout_s=30, what="the redelivered member to be acknowledged")
            await _marked(second, cfg)
            await pub.publish_many([b])
            (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid]) if v.group_id == gid]
            assert len(verdict.sessions) == 2
            assert _count(second, "prm_worker_probes_total{kind=probed}") == 1
            assert _count(second, "prm_worker_probes_total{kind=skipped}") == 1
            assert _count(second, "prm_worker_scored_total") == 1  # b only: a was not scored again
    finally:
        await ledger.aclose()


async def test_a_graceful_stop_flushes_the_pending_finish(kafka_bootstrap, redis_url, monkeypatch) -> None:
    """The finish after a verdict lingers for company; a stop does not lose it."""
    from scoring_workers import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "FINISH_LINGER_S", 600.0)  # only the stop can send it
    cfg = _config(kafka_bootstrap, redis_url)
    gid = f"g-{uuid.uuid4().hex[:6]}"
    ledger = GroupLedger.from_config(cfg.redis)
    try:
        async with running_worker(cfg, "w-flush") as worker, TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(make_group(gid, 1, turns=1, output_tokens=8))
            await wait_for_verdicts(cfg, [gid])

            async def pending() -> bool:
                return worker.ledger.pending_finishes == 1

            await eventually(pending, timeout_s=30, what="the finish to be handed over")
            assert await ledger.redis.exists(ledger.group_key(gid))  # decided, not finished yet
        assert not await ledger.redis.exists(ledger.group_key(gid))
        assert await ledger.probe_many([(gid, "x")]) == ["done"]
    finally:
        await ledger.aclose()


async def test_a_groups_members_are_parked_in_one_ledger_call(kafka_bootstrap, redis_url, monkeypatch) -> None:
    """Two groups already in the topic when the worker starts: each member is its own task,
    and the ledger's batching puts a group's parks into one call (a park waits for its
    groupmates; the one that completes the group does not), which decides the group; each
    group still gets one verdict listing its four members."""
    from scoring_workers import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "PARK_LINGER_S", 600.0)  # only company (or the deciding park) ends the wait
    monkeypatch.setattr(ledger_module, "PARK_UNSEEN_LINGER_S", 600.0)
    cfg = _config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    groups = [make_group(f"g-{uuid.uuid4().hex[:6]}", 4, turns=1, output_tokens=8) for _ in range(2)]
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.publish_many([m for g in groups for m in g])
    calls: list[list[str]] = []
    run = GroupLedger._run

    async def counted_run(self, ops):  # type: ignore[no-untyped-def]
        calls.append(sorted(type(op.item).__name__ for op in ops))
        return await run(self, ops)

    monkeypatch.setattr(GroupLedger, "_run", counted_run)
    gids = [g[0].group_id for g in groups]
    async with running_worker(cfg, "w-poll") as worker:
        verdicts = {v.group_id: v for v in await wait_for_verdicts(cfg, gids)}
        assert _count(worker, "prm_worker_scored_total") == 8
    parks = [c.count("_Park") for c in calls if "_Park" in c]  # parks per call (other work may ride along)
    assert sum(parks) == 8 and len(parks) <= 2 and min(parks) >= 4, calls
    for group in groups:
        verdict = verdicts[group[0].group_id]
        assert verdict.status == "accepted"
        assert sorted(s.trajectory_id for s in verdict.sessions) == sorted(m.trajectory_id for m in group)


async def test_a_park_that_fails_is_retried_without_scoring_again(kafka_bootstrap, redis_url, monkeypatch) -> None:
    """A member's park fails (an injected ConnectionError, as a Redis outage in the middle of
    it would raise): the record is retried with the score it has — probed again, parked, the
    group decided once — and none is scored twice."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    cfg = _config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group(f"g-{uuid.uuid4().hex[:6]}", 4, turns=1, output_tokens=8)
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.publish_many(group)
    park_many, calls = GroupLedger.park_many, []

    async def failing_once(self, requests):  # type: ignore[no-untyped-def]
        calls.append(len(requests))
        if len(calls) == 1:
            raise RedisConnectionError("connection reset by peer (injected)")
        return await park_many(self, requests)

    monkeypatch.setattr(GroupLedger, "park_many", failing_once)
    gid = group[0].group_id
    async with running_worker(cfg, "w-fallback") as worker:
        (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid]) if v.group_id == gid]
        assert _count(worker, "prm_worker_scored_total") == 4  # the failed park's score was kept
        assert _count(worker, "prm_worker_retries_total{error=ConnectionError}") >= 1
    assert calls == [1] * 5  # each member parks on its own (the ledger combines them), one of them twice
    assert verdict.status == "accepted"
    assert sorted(s.trajectory_id for s in verdict.sessions) == sorted(m.trajectory_id for m in group)
    verdicts = await read_topic(cfg, cfg.topics.verdicts)
    assert [r.key.decode() for r in verdicts] == [gid]  # decided once, one verdict
