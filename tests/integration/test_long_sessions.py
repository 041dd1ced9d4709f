"""Long agent sessions end to end on the embedded stack, with the default record limit.

A 100-turn session with a 128k-token context is over 1 MiB even in the compact form, so
it travels as chunk records; a branching long session travels compact. Both must come
back as verdicts whose rewards sit on the right tokens (the scorer's reward for a token
depends on the turn's whole prompt and conversation, so a worker that expanded a turn
wrongly would put different values there). Chunks are committed only when their
trajectory is whole, and chunks that never complete are dead-lettered.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import numpy as np
import pytest
import torch
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from infra.chunks import to_records
from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import make_consumer, make_producer
from infra.schema import ReadyTrajectory, dead_letter_from_record, expand_turns
from prm_pipeline.demo.synthetic import make_agent_session
from producers.publisher import TrajectoryPublisher
from tests.integration.harness import isolated_config, read_topic, running_worker, wait_for_verdicts
from tests.polling import eventually
from tests.scorers import token_echo_rewards

pytestmark = pytest.mark.integration

GROUP_TIMEOUT_S = 6.0
PARTITIONS = 2


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    name = f"long-{uuid.uuid4().hex[:8]}"
    cfg = isolated_config(
        name,
        kafka_bootstrap,
        redis_url,
        partitions=PARTITIONS,
        group_timeout_s=GROUP_TIMEOUT_S,
        scorer_timeout_s=60,
        scorers=[PRMScorerConfig("tests.scorers.TokenEchoScorer")],
    )
    assert cfg.kafka.max_message_bytes == 1_048_576  # the default limit
    return cfg


@pytest.fixture(scope="module")
async def worker(cfg: PipelineConfig):
    async with running_worker(cfg, "long-w0") as w:
        yield w


def _session(gid: str, turns: int, context: int, branch_at: int | None = None) -> ReadyTrajectory:
    return make_agent_session(
        trajectory_id=f"{gid}-t",
        session_id=f"{gid}-s",
        group_id=gid,
        turns=turns,
        context_tokens=context,
        branch_at=branch_at,
        rng=np.random.default_rng(turns),
    )


def _partition(key: str) -> int:
    return DefaultPartitioner()(key.encode(), list(range(PARTITIONS)), list(range(PARTITIONS)))


async def _committed(cfg: PipelineConfig, partition: int) -> int:
    consumer = make_consumer(cfg.kafka, group_id=cfg.worker.group_id)
    await consumer.start()
    try:
        return await consumer.committed(TopicPartition(cfg.topics.trajectories, partition)) or 0
    finally:
        await consumer.stop()


async def _wait_committed(cfg: PipelineConfig, partition: int, at_least: int, timeout_s: float = 20) -> int:
    """The partition's committed offset, once it is at least ``at_least``."""
    return await eventually(
        lambda: _committed(cfg, partition),
        accept=lambda offset: offset >= at_least,
        timeout_s=timeout_s,
        interval_s=0.1,
        what=f"partition {partition}'s commit to reach {at_least}",
    )


def _check_verdict(verdict, traj: ReadyTrajectory) -> None:
    assert verdict.status == "accepted", verdict.reason
    (session,) = verdict.sessions
    assert session.status == "scored"
    full = {i.interaction_id: i for i in traj.interactions}
    rebuilt = {i.interaction_id: i.model_response for i in expand_turns(session.turns)}  # the trainer's view
    assert set(rebuilt) == set(full)
    for iid, mr in rebuilt.items():
        assert np.array_equal(mr.input_tokens, full[iid].model_response.input_tokens)
        assert np.array_equal(mr.output_tokens, full[iid].model_response.output_tokens)
    leaves = set(full) - {i.parent_id for i in traj.interactions}
    assert {b.leaf_id for b in session.branches} == leaves
    for branch in session.branches:
        assert set(branch.token_rewards) == set(branch.path)
        for iid in branch.path:
            it = full[iid]
            want = token_echo_rewards(it.model_response.input_tokens, it.model_response.output_tokens, len(it.messages))
            assert np.array_equal(branch.token_rewards[iid].to_numpy(), want), iid


async def test_long_and_branching_long_sessions_get_verdicts_with_rewards_on_their_tokens(cfg, worker) -> None:
    long_gid, branch_gid = f"long-{uuid.uuid4().hex[:6]}", f"fork-{uuid.uuid4().hex[:6]}"
    long = _session(long_gid, 100, 128_000)
    branching = _session(branch_gid, 60, 72_000, branch_at=30)  # two chains: 60 and 29 more turns
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        assert len(pub.records(long)) >= 2  # over the limit even compact: chunked
        assert len(pub.records(branching)) == 1
        await pub.publish_many([long, branching])
    verdicts = {v.group_id: v for v in await wait_for_verdicts(cfg, [long_gid, branch_gid], timeout_s=120)}
    _check_verdict(verdicts[long_gid], long)
    _check_verdict(verdicts[branch_gid], branching)
    assert len(verdicts[branch_gid].sessions[0].branches) == 2


async def test_chunks_are_committed_only_when_their_trajectory_is_whole(cfg, worker) -> None:
    gid = f"half-{uuid.uuid4().hex[:6]}"
    part = _partition(gid)
    other = next(g for g in (f"next-{uuid.uuid4().hex[:6]}" for _ in range(1000)) if _partition(g) == part)
    chunked = _session(gid, 100, 128_000)
    first, *rest = to_records(chunked, cfg.kafka.max_message_bytes)
    (behind,) = to_records(_session(other, 4, 4_000), cfg.kafka.max_message_bytes)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        sent = await producer.send_and_wait(cfg.topics.trajectories, first[0], key=gid.encode(), headers=first[1])
        await producer.send_and_wait(cfg.topics.trajectories, behind[0], key=other.encode(), headers=behind[1])
        await wait_for_verdicts(cfg, [other])
        # the record behind the first chunk is done and the worker has committed all it may ...
        tp = TopicPartition(cfg.topics.trajectories, part)
        await eventually(
            lambda: worker._committer.tracker.in_flight({tp}) == 1 and not worker._committer.tracker.committable({tp}),
            timeout_s=20,
            what="the first record in flight and nothing committable",
        )
        # ... which stops at the first chunk: a crash now replays the whole trajectory
        assert await _committed(cfg, part) == sent.offset
        for value, headers in rest:
            last = await producer.send_and_wait(cfg.topics.trajectories, value, key=gid.encode(), headers=headers)
    finally:
        await producer.stop()
    (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=60) if v.group_id == gid]
    _check_verdict(verdict, chunked)
    assert await _wait_committed(cfg, part, last.offset + 1) == last.offset + 1


async def test_chunks_that_never_complete_are_dead_lettered_and_reject_their_group(cfg, worker) -> None:
    gid = f"lost-{uuid.uuid4().hex[:6]}"
    first, *_ = to_records(_session(gid, 100, 128_000), cfg.kafka.max_message_bytes)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        sent = await producer.send_and_wait(cfg.topics.trajectories, first[0], key=gid.encode(), headers=first[1])
    finally:
        await producer.stop()
    (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=GROUP_TIMEOUT_S + 30) if v.group_id == gid]
    assert verdict.status == "rejected" and verdict.reason.startswith("invalid_member")
    assert "IncompleteTrajectory" in verdict.reason
    letters = [
        dead_letter_from_record(r.value, r.headers)
        for r in await read_topic(cfg, cfg.topics.dead_letters)
        if r.key == gid.encode()
    ]
    (letter,) = letters
    assert letter.error_class == "IncompleteTrajectory" and letter.source_offset == sent.offset
    assert "only 1 of its" in letter.error_message and "worker.group_timeout_s" in letter.error_message
    assert await _wait_committed(cfg, sent.partition, sent.offset + 1) >= sent.offset + 1


async def test_a_chunked_member_is_read_back_from_its_first_chunk(cfg) -> None:
    """A worker that did not consume a chunked member reads it back from the log: from its
    parked (first chunk) coordinates on, past other records, until its last chunk."""
    from infra.kafka import ensure_topics
    from infra.schema import SessionResult, compact_turns
    from scoring_workers.ledger import ParkedMember
    from scoring_workers.tokens import MemberTokens

    await ensure_topics(cfg.kafka, cfg.topics)
    gid = f"back-{uuid.uuid4().hex[:6]}"
    traj = _session(gid, 100, 128_000)
    records = to_records(traj, cfg.kafka.max_message_bytes)
    (between,) = to_records(_session(gid, 2, 2_000), cfg.kafka.max_message_bytes)  # another record in between
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        first = await producer.send_and_wait(
            cfg.topics.trajectories, records[0][0], key=gid.encode(), headers=records[0][1]
        )
        await producer.send_and_wait(cfg.topics.trajectories, between[0], key=gid.encode(), headers=between[1])
        for value, headers in records[1:]:
            await producer.send_and_wait(cfg.topics.trajectories, value, key=gid.encode(), headers=headers)
    finally:
        await producer.stop()
    tokens = MemberTokens(cfg)
    try:
        (member,) = await tokens.members(
            gid,
            [
                ParkedMember(
                    SessionResult(
                        session_id=traj.session_id, trajectory_id=traj.trajectory_id, status="scored", stats={"x": 1.0}
                    ),
                    first.partition,
                    first.offset,
                )
            ],
        )
    finally:
        await tokens.aclose()
    assert member.status == "scored" and member.turns == compact_turns(traj.interactions)
    assert tokens.log_reads == len(records) + 1


async def test_publish_refuses_a_session_over_every_limit_in_one_line_before_sending_anything(
    kafka_bootstrap, redis_url, tmp_path
) -> None:
    """`prm-pipeline publish` checks every line (size included) before it sends any; a session no
    chunking fits is one line naming it, its size, its turns and the setting — no traceback."""
    import subprocess
    import sys

    from infra import jsonl
    from infra.kafka import ensure_topics
    from prm_pipeline.demo.processes import write_config

    cfg = isolated_config(
        f"pubcli-{uuid.uuid4().hex[:8]}", kafka_bootstrap, redis_url, kafka={"max_message_bytes": 1024}
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    small, big = _session("cli-small", 2, 400), _session("cli-big", 40, 40_000)
    jsonl.write(tmp_path / "in.jsonl", [small, big])
    config = write_config(cfg, tmp_path / "config.yaml")
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), "publish", str(tmp_path / "in.jsonl")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("error: session 'cli-big-s' (trajectory 'cli-big-t', group 'cli-big') is ")
    assert " bytes in compact form over 40 turns" in line and "kafka.max_message_bytes=1024" in line
    assert await read_topic(cfg, cfg.topics.trajectories) == []  # the small session before it was not sent either


async def test_a_group_of_long_sessions_is_accepted_on_the_default_config(kafka_bootstrap, redis_url) -> None:
    """Two 100-turn, 128k-token sessions: with their turns the verdict is over the default
    1 MiB record limit (``inline`` rejects it: verdict_too_large). On the default config
    (``worker.verdict_tokens: auto``) it is published ``accepted`` naming the members'
    (chunked) records, and the trainer's consumer reads every token back; a small group
    next to it stays inline."""
    from infra.kafka import record_size
    from infra.schema import compact_turns, decode_verdict, encode
    from prm_pipeline.demo.synthetic import make_group
    from shaper import VerdictConsumer
    from shaper.batch import collate, export_group

    auto = isolated_config(
        f"longauto-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        partitions=PARTITIONS,
        group_timeout_s=GROUP_TIMEOUT_S * 10,
        scorer_timeout_s=60,
        scorers=[PRMScorerConfig("tests.scorers.TokenEchoScorer")],
    )
    assert auto.worker.verdict_tokens == "auto" and auto.kafka.max_message_bytes == 1_048_576  # the defaults
    gid, small_gid = f"pair-{uuid.uuid4().hex[:6]}", f"small-{uuid.uuid4().hex[:6]}"
    group = [
        make_agent_session(
            trajectory_id=f"{gid}-t{k}",
            session_id=f"{gid}-s{k}",
            group_id=gid,
            group_size=2,
            turns=100,
            context_tokens=128_000,
            rng=np.random.default_rng(k),
        )
        for k in range(2)
    ]
    small = make_group(small_gid, 2, turns=2, output_tokens=16)
    originals = {t.trajectory_id: t for t in group + small}
    async with running_worker(auto, "longauto-w0"):
        async with TrajectoryPublisher(auto.kafka, auto.topics) as pub:
            assert len(pub.records(group[0])) >= 2  # each member is chunked
            await pub.publish_many(group + small)
        await wait_for_verdicts(auto, [gid, small_gid], timeout_s=120)
    raw = {
        v.group_id: (v, len(r.value))
        for r in await read_topic(auto, auto.topics.verdicts)
        for v in [decode_verdict(r.value, r.headers)]
    }
    (verdict, size), (small_verdict, _) = raw[gid], raw[small_gid]
    assert verdict.status == "accepted", verdict.reason
    assert all(s.status == "scored" and s.tokens_at is not None and not s.turns for s in verdict.sessions)
    assert size < auto.kafka.max_message_bytes
    # the same verdict with the turns inline: over the limit (what `inline` rejects)
    inline = {
        v.group_id: msgspec.structs.replace(
            v,
            sessions=[
                msgspec.structs.replace(s, turns=compact_turns(originals[s.trajectory_id].interactions), tokens_at=None)
                for s in v.sessions
            ],
        )
        for v in (verdict, small_verdict)
    }
    assert record_size(gid.encode(), *encode(inline[gid])) > auto.kafka.max_message_bytes
    assert small_verdict.status == "accepted", small_verdict.reason  # a group that fits stays inline
    assert small_verdict == inline[small_gid]
    # the trainer's consumer reads the long group's tokens back: its batch is the inline verdict's
    async with VerdictConsumer(
        auto, batch_groups=1, group_filter=None, device="cpu", group_id=f"trainer-{gid}"
    ) as consumer:
        batches = [await consumer.next_batch(idle_timeout_s=10) for _ in range(2)]
    by_group = {b.group_ids[0]: b for b in batches if b is not None}
    assert set(by_group) == {gid, small_gid}
    for group_id, batch in by_group.items():
        expected = collate([export_group(inline[group_id])])
        assert torch.equal(batch.input_ids, expected.input_ids), group_id
        assert torch.equal(batch.token_rewards, expected.token_rewards), group_id
    for session in inline[gid].sessions:  # and the rewards sit on the right tokens
        _check_verdict(msgspec.structs.replace(inline[gid], sessions=[session]), originals[session.trajectory_id])
