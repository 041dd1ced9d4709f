"""The scoring pipeline end to end: publisher -> two worker processes -> verdicts.

Real broker, real Redis, real worker processes (``prm-pipeline worker``). One pair of
workers serves the whole module; each test uses its own group ids.
"""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from infra.config import (
    PipelineConfig,
    PRMScorerConfig,
)
from infra.kafka import make_producer
from infra.schema import dead_letter_from_record, encode
from prm_pipeline.demo.synthetic import make_group, make_session
from producers.publisher import TrajectoryPublisher
from tests.integration.harness import isolated_config, read_topic, wait_for_verdicts, worker_processes

pytestmark = pytest.mark.integration

MAX_TOKENS = 32  # LengthBudgetScorer budget: 16-token turns score 1.0, 64-token turns 0.0
GROUP_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    name = f"pipe-{uuid.uuid4().hex[:8]}"
    return isolated_config(
        name,
        kafka_bootstrap,
        redis_url,
        scorer_timeout_s=5,
        group_timeout_s=GROUP_TIMEOUT_S,
        scorers=[
            PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": MAX_TOKENS}),
            PRMScorerConfig("tests.scorers.FailOnMarkerScorer"),
        ],
    )


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("workers")) as procs:
        yield procs


def _gid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:6]}"


async def _publish(cfg: PipelineConfig, messages) -> None:
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.publish_many(messages)


async def _verdicts_for(cfg: PipelineConfig, *groups: str, settle_s: float = 0.0):
    """Verdicts of ``groups``; with ``settle_s``, keep reading that long to catch duplicates."""
    await wait_for_verdicts(cfg, groups)
    if settle_s:
        end = time.monotonic() + settle_s
        records = await read_topic(cfg, cfg.topics.verdicts, until=end, stop_when=lambda _: False)
    else:
        records = await read_topic(cfg, cfg.topics.verdicts)
    from infra.schema import decode_verdict

    out = [decode_verdict(r.value, r.headers) for r in records]
    return [v for v in out if v.group_id in groups]


async def test_accepted_group_has_exact_token_rewards(cfg, workers) -> None:
    gid = _gid("acc")
    short = make_session(
        trajectory_id=f"{gid}-a",
        session_id=f"{gid}-a",
        group_id=gid,
        group_size=2,
        turns=2,
        output_tokens=16,
        outcome_reward=1.0,
    )
    long = make_session(
        trajectory_id=f"{gid}-b",
        session_id=f"{gid}-b",
        group_id=gid,
        group_size=2,
        turns=2,
        output_tokens=64,
        outcome_reward=0.0,
    )
    await _publish(cfg, [short, long])
    (verdict,) = await _verdicts_for(cfg, gid)
    assert verdict.status == "accepted" and verdict.reason == ""
    by_traj = {s.trajectory_id: s for s in verdict.sessions}
    assert set(by_traj) == {f"{gid}-a", f"{gid}-b"}
    for traj, length, value in ((f"{gid}-a", 16, 1.0), (f"{gid}-b", 64, 0.0)):
        session = by_traj[traj]
        assert session.status == "scored"
        (branch,) = session.branches
        assert set(branch.token_rewards) == {f"{traj}-t0", f"{traj}-t1"}
        for rewards in branch.token_rewards.values():
            assert rewards.to_numpy().tolist() == [value] * length
        assert branch.scorer_totals["length_budget"] == pytest.approx(2 * value)
        assert session.stats["rollout/prm_turn_reward/length_budget"] == pytest.approx(value)
    assert by_traj[f"{gid}-a"].outcome_reward == 1.0 and by_traj[f"{gid}-b"].outcome_reward == 0.0  # raw
    assert [s.name for s in verdict.scorers] == ["length_budget", "fail_on_marker"]


async def test_raising_scorer_rejects_the_group_but_keeps_peer_stats(cfg, workers) -> None:
    gid = _gid("rej")
    ok = make_session(
        trajectory_id=f"{gid}-ok", session_id=f"{gid}-ok", group_id=gid, group_size=2, turns=2, output_tokens=16
    )
    bad = make_session(
        trajectory_id=f"{gid}-bad", session_id=f"{gid}-FAIL", group_id=gid, group_size=2, turns=2, output_tokens=16
    )
    await _publish(cfg, [ok, bad])
    (verdict,) = await _verdicts_for(cfg, gid)
    assert (verdict.status, verdict.reason_code) == ("rejected", "scorer_error"), verdict.reason
    # for people: names the member and says why (the scorer's message)
    assert verdict.reason.startswith(f"scorer_error: member '{gid}-bad' (session '{gid}-FAIL'): "), verdict.reason
    assert "scripted failure" in verdict.reason
    by_traj = {s.trajectory_id: s for s in verdict.sessions}
    assert by_traj[f"{gid}-bad"].status == "failed"
    assert "scripted failure" in by_traj[f"{gid}-bad"].error
    bad_result = by_traj[f"{gid}-bad"]  # why, typed: no reader parses the message
    assert (bad_result.error_code, bad_result.error_scorer) == ("scorer_error", "fail_on_marker")
    assert "scripted failure" in bad_result.error_detail
    assert by_traj[f"{gid}-bad"].branches == [] and by_traj[f"{gid}-bad"].stats == {}  # no partial stats
    assert by_traj[f"{gid}-ok"].status == "scored"
    assert by_traj[f"{gid}-ok"].stats["rollout/prm_turn_reward/length_budget"] == pytest.approx(1.0)


async def test_missing_member_rejects_after_deadline_exactly_once(cfg, workers) -> None:
    gid = _gid("miss")
    members = make_group(gid, 3, turns=1, output_tokens=16)
    t0 = time.monotonic()
    await _publish(cfg, members[:2])
    verdicts = await _verdicts_for(cfg, gid, settle_s=2.0)
    assert len(verdicts) == 1, [v.worker_id for v in verdicts]
    (verdict,) = verdicts
    assert time.monotonic() - t0 >= GROUP_TIMEOUT_S * 0.9  # not before the deadline
    assert (verdict.status, verdict.reason_code) == ("rejected", "missing_sessions"), verdict.reason
    assert sorted(s.trajectory_id for s in verdict.sessions) == sorted(m.trajectory_id for m in members[:2])
    # the straggler arrives late: acknowledged, no second verdict
    await _publish(cfg, members[2:])
    assert len(await _verdicts_for(cfg, gid, settle_s=1.5)) == 1


async def test_discard_before_members_arrive(cfg, workers) -> None:
    # One-member groups right behind their discards: each member alone would complete its
    # group, so it must see the discard's decision first (the worker orders records of a
    # group behind its discard).
    gids = [_gid("disc0") for _ in range(5)]
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        for gid in gids:
            await pub.discard_group(gid, "prompt filtered")
            await pub.publish_many(make_group(gid, 1, turns=1, output_tokens=16))
    verdicts = await _verdicts_for(cfg, *gids, settle_s=1.5)
    assert sorted((v.group_id, v.status, v.reason_code, v.reason) for v in verdicts) == sorted(
        (gid, "discarded", "discarded", "prompt filtered") for gid in gids
    )


async def test_discard_after_members_arrive(cfg, workers) -> None:
    gid = _gid("disc1")
    members = make_group(gid, 3, turns=1, output_tokens=16)
    await _publish(cfg, members[:2])
    await _publish(cfg, [])  # members flushed first; the discard follows in the same partition
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.discard_group(gid, "trainer no longer needs it")
    verdicts = await _verdicts_for(cfg, gid, settle_s=1.5)
    assert [(v.status, v.reason_code, v.reason) for v in verdicts] == [
        ("discarded", "discarded", "trainer no longer needs it")
    ]
    assert all(s.status == "discarded" and not s.branches for s in verdicts[0].sessions)


async def test_duplicate_trajectory_yields_one_verdict(cfg, workers) -> None:
    gid = _gid("dup")
    members = make_group(gid, 2, turns=1, output_tokens=16)
    await _publish(cfg, [members[0], members[0], members[1], members[0]])
    verdicts = await _verdicts_for(cfg, gid, settle_s=1.5)
    assert len(verdicts) == 1 and verdicts[0].status == "accepted"
    assert sorted(s.trajectory_id for s in verdicts[0].sessions) == sorted(m.trajectory_id for m in members)


async def test_bad_records_are_dead_lettered_and_workers_keep_going(cfg, workers) -> None:
    gid = _gid("after-dlq")
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        valid, headers = encode(make_group(gid, 1, turns=1, output_tokens=16)[0])
        await producer.send_and_wait(cfg.topics.trajectories, b"\x93garbage\xff", key=b"junk", headers=headers)
        await producer.send_and_wait(
            cfg.topics.trajectories, valid, key=b"v9", headers=[("prm-schema-version", b"99"), ("prm-kind", b"ready")]
        )
    finally:
        await producer.stop()
    await _publish(cfg, make_group(gid, 1, turns=1, output_tokens=16))
    (verdict,) = await _verdicts_for(cfg, gid)
    assert verdict.status == "accepted"  # the workers kept going

    def both(records: list) -> bool:
        return {r.key for r in records} >= {b"junk", b"v9"}

    records = await read_topic(cfg, cfg.topics.dead_letters, until=time.monotonic() + 20, stop_when=both)
    letters = {r.key: dead_letter_from_record(r.value, r.headers) for r in records if r.key in (b"junk", b"v9")}
    assert letters[b"junk"].error_class == "InvalidMessage"
    assert letters[b"junk"].payload == b"\x93garbage\xff"  # original bytes kept
    assert letters[b"v9"].error_class == "UnknownSchemaVersion" and "'99'" in letters[b"v9"].error_message
    assert letters[b"v9"].source_topic == cfg.topics.trajectories and letters[b"v9"].source_offset >= 0


async def test_two_branches_sharing_a_root_get_branch_local_rewards(cfg, workers) -> None:
    gid = _gid("branch")
    # turns=2, branch_at=0: root t0 -> t1 and root t0 -> t1b (two leaves)
    traj = make_session(
        trajectory_id=f"{gid}-x",
        session_id=f"{gid}-x",
        group_id=gid,
        group_size=1,
        turns=2,
        branch_at=0,
        output_tokens=16,
    )
    await _publish(cfg, [traj])
    (verdict,) = await _verdicts_for(cfg, gid)
    (session,) = verdict.sessions
    assert verdict.status == "accepted"
    leaves = {b.leaf_id: b for b in session.branches}
    assert set(leaves) == {f"{gid}-x-t1", f"{gid}-x-t1b"}
    for leaf, branch in leaves.items():
        assert branch.path == [f"{gid}-x-t0", leaf]
        assert set(branch.token_rewards) == {f"{gid}-x-t0", leaf}  # the shared root scored per branch
        assert branch.scorer_totals["length_budget"] == pytest.approx(2.0)


async def test_persistent_hitl_session_exports_are_each_consumed_once(cfg, workers) -> None:
    g1, g2 = _gid("hitl"), _gid("hitl")
    a = make_session(
        trajectory_id=f"{g1}-t", session_id="__hitl__", group_id=g1, group_size=1, turns=1, output_tokens=16
    )
    b = make_session(
        trajectory_id=f"{g2}-t", session_id="__hitl__", group_id=g2, group_size=1, turns=1, output_tokens=16
    )
    await _publish(cfg, [a, b, a])
    verdicts = await _verdicts_for(cfg, g1, g2, settle_s=1.0)
    assert sorted((v.group_id, v.status) for v in verdicts) == sorted([(g1, "accepted"), (g2, "accepted")])


async def test_oversized_trajectory_is_refused_before_sending(cfg) -> None:
    """Over the limit even in MAX_CHUNKS chunk records: refused, naming the session and the setting."""
    from infra.kafka import MessageTooLarge

    small = msgspec.structs.replace(cfg.kafka, max_message_bytes=4096)
    (big,) = make_group(_gid("big"), 1, turns=1, output_tokens=200_000)
    async with TrajectoryPublisher(small, cfg.topics) as pub:
        with pytest.raises(MessageTooLarge, match=r"over 1 turns: \d+ records of kafka.max_message_bytes=4096"):
            await pub.publish_ready(big)
        assert pub.records_sent == 0
