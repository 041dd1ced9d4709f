"""Poison messages never block anything (an in-process worker on the real broker and Redis).

* a group whose verdict exceeds ``kafka.max_message_bytes`` (each member fits) is
  published at once as ``rejected`` / ``verdict_too_large`` (``worker.verdict_tokens: inline``), and a group published after
  it is still decided by its deadline, promptly;
* a decision the sweeper cannot publish (a broken entry in Redis) costs that group
  only: the sweeper goes on with the others;
* a record just under the size limit, whose dead letter (payload + headers) would be
  over it, is dead-lettered with its payload capped so the whole letter fits;
* a dead-lettered record whose key names its group rejects that group at once
  (``invalid_member``, naming the dead letter's coordinates) — its valid peers do not
  wait for the group deadline.
"""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics, make_producer, record_size
from infra.schema import GroupVerdict, SessionResult, dead_letter_from_record, encode
from prm_pipeline.demo.synthetic import make_group, make_session
from producers.publisher import TrajectoryPublisher
from scoring_workers.ledger import GroupLedger
from tests.integration.harness import isolated_config, read_topic, running_worker, wait_for_verdicts

pytestmark = pytest.mark.integration

LIMIT = 64 * 1024
GROUP_TIMEOUT_S = 6.0


def _config(kafka_bootstrap: str, redis_url: str, **worker: object) -> PipelineConfig:
    worker.setdefault("group_timeout_s", GROUP_TIMEOUT_S)
    return isolated_config(
        f"poison-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        kafka={"max_message_bytes": LIMIT},
        scorers=[PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 64})],
        **worker,
    )


async def _verdict(cfg: PipelineConfig, gid: str, timeout_s: float) -> GroupVerdict:
    verdicts = await wait_for_verdicts(cfg, [gid], timeout_s=timeout_s)
    return next(v for v in verdicts if v.group_id == gid)


async def test_oversized_verdict_is_rejected_and_never_blocks_later_groups(kafka_bootstrap, redis_url) -> None:
    # inline: the default (auto) would name the members' records instead (test_long_sessions.py)
    cfg = _config(kafka_bootstrap, redis_url, verdict_tokens="inline")
    big = make_group(f"big-{uuid.uuid4().hex[:6]}", 3, turns=2, output_tokens=2600)
    sizes = [record_size(m.group_id.encode(), *encode(m)) for m in big]
    assert max(sizes) < LIMIT < sum(sizes), sizes  # each member fits, the verdict cannot
    late = make_group(f"late-{uuid.uuid4().hex[:6]}", 2, turns=1, output_tokens=8)[:1]  # needs its deadline
    async with running_worker(cfg, "w-poison") as worker:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(big)
            await pub.flush()
            await pub.publish_many(late)
        t_late = time.monotonic()
        verdict = await _verdict(cfg, big[0].group_id, timeout_s=20)
        assert verdict.status == "rejected" and verdict.reason_code == "verdict_too_large", verdict.reason
        assert f"max_message_bytes={LIMIT}" in verdict.reason and "it was accepted" in verdict.reason
        assert len(verdict.sessions) == 3
        assert all(s.status == "scored" and s.stats and not s.turns for s in verdict.sessions)
        late_verdict = await _verdict(cfg, late[0].group_id, timeout_s=GROUP_TIMEOUT_S + 10)
        waited = time.monotonic() - t_late
        assert late_verdict.status == "rejected" and late_verdict.reason_code == "missing_sessions"
        assert waited < GROUP_TIMEOUT_S + 3, f"the later group waited {waited:.1f}s for a {GROUP_TIMEOUT_S}s deadline"
        snapshot = worker.telemetry.snapshot()
        assert snapshot["prm_worker_verdicts_total{reason=verdict_too_large,status=rejected}"] == 1


async def test_a_broken_decision_costs_the_sweeper_that_group_only(kafka_bootstrap, redis_url) -> None:
    cfg = _config(kafka_bootstrap, redis_url)
    ledger = GroupLedger.from_config(cfg.redis)
    rotten = f"rotten-{uuid.uuid4().hex[:6]}"
    try:  # a decided group whose stored scorers blob cannot be decoded, due before anything else
        member = make_session(
            trajectory_id=f"{rotten}-0",
            session_id=f"{rotten}-s0",
            group_id=rotten,
            group_size=2,
            turns=1,
            output_tokens=4,
        )
        await ledger.park(
            SessionResult(session_id=member.session_id, trajectory_id=member.trajectory_id, status="scored"),
            group_id=rotten,
            group_size=2,
            group_timeout_s=600,
            worker_id="planted",
            scorers=b"\x90",
        )
        await ledger.decide(
            rotten, "discard", worker_id="planted", scorers=b"\x90", group_timeout_s=600, republish_grace_s=5
        )
        state_key = ledger.keys(rotten)[0]
        await ledger.redis.hset(state_key, mapping={"scorers": b"\xc1", "decided_at": "0"})
        await ledger.redis.zadd(ledger.deadlines_key, {rotten: 0})
    finally:
        await ledger.aclose()
    late = make_group(f"late-{uuid.uuid4().hex[:6]}", 2, turns=1, output_tokens=8)[:1]
    async with running_worker(cfg, "w-poison") as worker:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(late)
        t_late = time.monotonic()
        late_verdict = await _verdict(cfg, late[0].group_id, timeout_s=GROUP_TIMEOUT_S + 10)
        waited = time.monotonic() - t_late
        assert late_verdict.reason.startswith("missing_sessions")
        assert waited < GROUP_TIMEOUT_S + 3, f"the later group waited {waited:.1f}s for a {GROUP_TIMEOUT_S}s deadline"
        failures = {k: v for k, v in worker.telemetry.snapshot().items() if k.startswith("prm_worker_sweep_failures")}
        assert sum(failures.values()) >= 1, failures


async def test_dead_letter_of_a_record_just_under_the_limit_fits(kafka_bootstrap, redis_url) -> None:
    # dead_letter_max_bytes == max_message_bytes: the payload alone fits, the headers push it over
    cfg = _config(kafka_bootstrap, redis_url, dead_letter_max_bytes=LIMIT)
    key = f"near-{uuid.uuid4().hex[:6]}".encode()
    headers = [("prm-schema-version", b"1"), ("prm-kind", b"ready")]
    value = b"\xc1" * (LIMIT - 200)
    assert record_size(key, value, headers) <= LIMIT
    await ensure_topics(cfg.kafka, cfg.topics)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(cfg.topics.trajectories, value, key=key, headers=headers)
    finally:
        await producer.stop()
    async with running_worker(cfg, "w-poison"):
        records = await read_topic(
            cfg,
            cfg.topics.dead_letters,
            until=time.monotonic() + 20,
            stop_when=lambda rs: any(r.key == key for r in rs),
        )
        (record,) = [r for r in records if r.key == key]
        letter = dead_letter_from_record(record.value, record.headers)
        assert record_size(record.key, record.value, record.headers) <= LIMIT
        assert letter.original_size == len(value) and value.startswith(letter.payload)
        assert len(letter.payload) > LIMIT // 2 and letter.error_class == "InvalidMessage"


async def test_dead_lettered_member_rejects_its_group_at_once(kafka_bootstrap, redis_url) -> None:
    cfg = _config(kafka_bootstrap, redis_url, group_timeout_s=120)
    group = make_group(f"bad-{uuid.uuid4().hex[:6]}", 3, turns=1, output_tokens=8)
    gid = group[0].group_id
    value, headers = encode(group[1])
    await ensure_topics(cfg.kafka, cfg.topics)
    async with running_worker(cfg, "w-poison"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_ready(group[0])
            await pub.flush()
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:  # member 1 arrives truncated, under its group's key
            await producer.send_and_wait(
                cfg.topics.trajectories, value[: len(value) // 2], key=gid.encode(), headers=headers
            )
        finally:
            await producer.stop()
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_ready(group[2])
        t0 = time.monotonic()
        verdict = await _verdict(cfg, gid, timeout_s=20)
        assert time.monotonic() - t0 < 20  # not the 120 s group deadline
        assert verdict.status == "rejected" and verdict.reason_code == "invalid_member", verdict.reason
        letters = await read_topic(
            cfg,
            cfg.topics.dead_letters,
            until=time.monotonic() + 10,
            stop_when=lambda rs: any(r.key == gid.encode() for r in rs),
        )
        (dl,) = [dead_letter_from_record(r.value, r.headers) for r in letters if r.key == gid.encode()]
        assert f"{dl.source_topic}:{dl.source_partition}@{dl.source_offset}" in verdict.reason
        # the member parked before the bad record keeps its result; the later one is acknowledged
        assert [s.trajectory_id for s in verdict.sessions] in (
            [group[0].trajectory_id],
            [group[0].trajectory_id, group[2].trajectory_id],
        )
        assert msgspec.json.encode(verdict)  # well-formed
