"""Redis carries scores, not tokens: the parked hash holds no token ids or log-probs, and a
worker that did not consume a member reads its tokens back from the log, so the verdict
is the same whoever decides the group."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest

from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics
from infra.readback import FETCH_BYTES, TrajectoryReader, Wanted
from infra.schema import ReadyTrajectory, compact_turns
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from scoring_workers.ledger import GroupLedger, decode_parked
from tests.integration.harness import isolated_config, running_worker, wait_for_verdicts
from tests.polling import eventually

pytestmark = pytest.mark.integration


def _config(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return isolated_config(
        f"tokens-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        group_timeout_s=120,
        scorers=[PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24})],
    )


async def _parked(cfg: PipelineConfig, group_id: str, n: int, timeout_s: float = 30) -> dict[str, bytes]:
    """The group's parked members once ``n`` are parked (a poll with a deadline)."""
    ledger = GroupLedger.from_config(cfg.redis)
    try:
        return await eventually(
            lambda: ledger.view.parked_blobs(group_id),
            accept=lambda members: len(members) >= n,
            timeout_s=timeout_s,
            what=f"{n} members parked",
        )
    finally:
        await ledger.aclose()


def _token_samples(traj: ReadyTrajectory) -> list[bytes]:
    """Distinctive byte strings of the trajectory's tokens and log-probs (32 bytes each)."""
    out = []
    for it in traj.interactions:
        mr = it.model_response
        assert mr is not None and mr.output_len >= 8
        out += [mr.output_tokens_raw[:32], mr.output_logprobs_raw[:32], mr.input_tokens_raw[:32]]
    return out


async def test_parked_hash_holds_no_token_ids_or_logprobs(kafka_bootstrap, redis_url) -> None:
    cfg = _config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group(f"park-{uuid.uuid4().hex[:6]}", 4, turns=3, output_tokens=(64, 128))
    gid = group[0].group_id
    async with running_worker(cfg, "w-park"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(group[:3])  # the group stays open: its members stay parked
        members = await _parked(cfg, gid, 3)
        for tid, blob in members.items():
            parked = decode_parked(blob)
            assert parked.result.status == "scored" and parked.result.stats and parked.result.branches
            assert parked.result.turns == [] and parked.partition >= 0 and parked.offset >= 0
            traj = next(t for t in group if t.trajectory_id == tid)
            for sample in _token_samples(traj):
                assert sample not in blob, f"{tid!r}: token bytes found in Redis"
            assert len(blob) < 2048, f"parked blob is {len(blob)} bytes"
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_ready(group[3])
        (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=30) if v.group_id == gid]
    assert verdict.status == "accepted"
    by_id = {t.trajectory_id: t for t in group}
    for s in verdict.sessions:  # the verdict still carries every member's tokens
        assert s.turns == compact_turns(by_id[s.trajectory_id].interactions)


async def test_a_worker_that_did_not_consume_members_reads_their_tokens_from_the_log(
    kafka_bootstrap, redis_url
) -> None:
    cfg = _config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    groups = [make_group(f"back{k}-{uuid.uuid4().hex[:6]}", 4, turns=2, output_tokens=(32, 64)) for k in range(2)]
    async with running_worker(cfg, "w-first"):  # scores and parks three members of each, then leaves (commits them)
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            for group in groups:
                await pub.publish_many(group[:3])
        for group in groups:
            await _parked(cfg, group[0].group_id, 3)
    verdicts = []
    async with running_worker(cfg, "w-second") as second:  # never saw them: their tokens come from the log
        for group in groups:  # one group after the other: two separate read-backs
            async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                await pub.publish_ready(group[3])
            gid = group[0].group_id
            verdicts += [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=30) if v.group_id == gid]
        assert second._tokens.log_reads == 6
    for group, verdict in zip(groups, verdicts):
        assert verdict.status == "accepted" and verdict.worker_id == "w-second"
        by_id = {t.trajectory_id: t for t in group}
        assert [s.trajectory_id for s in verdict.sessions] == sorted(by_id)
        for s in verdict.sessions:
            assert s.turns == compact_turns(by_id[s.trajectory_id].interactions)


async def test_a_member_whose_record_cannot_be_read_back_fails_as_tokens_unavailable(
    kafka_bootstrap, redis_url
) -> None:
    """The log no longer holds the member (another record at its offset, or bytes that no longer
    decode): its member fails with ``tokens_unavailable`` naming the coordinates, never a verdict
    without tokens; a member whose record is intact still gets its turns."""
    from infra.kafka import make_producer
    from infra.schema import SessionResult, encode
    from scoring_workers.ledger import ParkedMember
    from scoring_workers.tokens import MemberTokens

    cfg = _config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group(f"gone-{uuid.uuid4().hex[:6]}", 3, turns=2, output_tokens=(16, 32))
    gid, topic = group[0].group_id, cfg.topics.trajectories
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        coords = []
        for traj in group[:2]:
            value, headers = encode(traj)
            meta = await producer.send_and_wait(topic, value, key=gid.encode(), headers=headers)
            coords.append((meta.partition, meta.offset))
        junk = await producer.send_and_wait(topic, b"\xc1 no longer a trajectory", key=gid.encode())
    finally:
        await producer.stop()

    def parked(traj: ReadyTrajectory, partition: int, offset: int) -> ParkedMember:
        return ParkedMember(
            SessionResult(
                session_id=traj.session_id, trajectory_id=traj.trajectory_id, status="scored", stats={"x": 1.0}
            ),
            partition,
            offset,
        )

    tokens = MemberTokens(cfg)
    try:
        intact, moved, garbled = await tokens.members(
            gid,
            [
                parked(group[0], *coords[0]),
                parked(group[2], *coords[1]),  # its offset holds group[1]'s record
                parked(group[1], junk.partition, junk.offset),
            ],
        )
    finally:
        await tokens.aclose()
    assert intact.status == "scored" and intact.turns == compact_turns(group[0].interactions)
    for member, (partition, offset) in ((moved, coords[1]), (garbled, (junk.partition, junk.offset))):
        assert member.status == "failed" and member.turns == [] and member.stats == {}
        assert member.error == f"tokens_unavailable: record {topic}:{partition}@{offset} could not be read back"
        assert (member.error_code, member.error_detail) == (  # typed, like every other failure
            "tokens_unavailable",
            f"record {topic}:{partition}@{offset} could not be read back",
        )
    assert tokens.log_reads == 3


# --------------------------------------------------------------------------- worker.verdict_tokens: reference
def _reference_config(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return isolated_config(
        f"tokref-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        group_timeout_s=120,
        verdict_tokens="reference",
        scorers=[PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24})],
    )


async def test_reference_verdicts_name_records_and_every_reader_reads_the_same_turns(
    kafka_bootstrap, redis_url
) -> None:
    """With ``reference`` the verdict carries coordinates, not tokens; the trainer's consumer,
    the verdict waiter and ``verdicts --tokens`` read back exactly the worker's turns."""
    import io

    import msgspec
    import torch

    from infra.readback import VerdictTokens
    from infra.schema import decode_verdict
    from prm_pipeline.verdict_dump import _dump
    from shaper import VerdictConsumer
    from shaper.batch import collate, export_group
    from shaper.reward_client import VerdictWaiter
    from tests.integration.harness import read_topic

    cfg = _reference_config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group(f"ref-{uuid.uuid4().hex[:6]}", 4, turns=3, output_tokens=(64, 128))
    gid = group[0].group_id
    by_id = {t.trajectory_id: t for t in group}
    waiter = VerdictWaiter(cfg)
    await waiter.start()
    try:
        fut = waiter.expect(gid)
        async with running_worker(cfg, "w-ref"):
            async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                await pub.publish_many(group)
            await wait_for_verdicts(cfg, [gid], timeout_s=30)
        waited = await asyncio.wait_for(fut, 30)
    finally:
        await waiter.aclose()
    (record,) = [r for r in await read_topic(cfg, cfg.topics.verdicts) if r.key == gid.encode()]
    raw = decode_verdict(record.value, record.headers)
    assert raw.status == "accepted"
    for s in raw.sessions:  # the record names each member's ready record instead of carrying its tokens
        assert s.turns == [] and s.tokens_at is not None and s.tokens_at.offset >= 0
        for sample in _token_samples(by_id[s.trajectory_id]):
            assert sample not in record.value
    tokens = VerdictTokens(cfg)
    try:
        resolved = await tokens.resolve_one(raw)
    finally:
        await tokens.aclose()
    inline_value = msgspec.msgpack.encode(resolved)  # the rewards stay on the verdict: only the tokens leave it
    assert len(record.value) * 2 < len(inline_value), (len(record.value), len(inline_value))
    for verdict in (resolved, waited):
        assert verdict.status == "accepted"
        for s in verdict.sessions:
            assert s.tokens_at is None and s.turns == compact_turns(by_id[s.trajectory_id].interactions)
    out = io.StringIO()
    await _dump(cfg, out, from_beginning=True, max_count=1, timeout_s=5, tokens=True)
    assert '"interactions"' in out.getvalue() and gid in out.getvalue()
    async with VerdictConsumer(
        cfg, batch_groups=1, group_filter=None, device="cpu", group_id=f"trainer-{gid}"
    ) as consumer:
        batch = await consumer.next_batch(idle_timeout_s=10)
    assert batch is not None and set(batch.group_ids) == {gid}
    expected = collate([export_group(resolved)])
    assert torch.equal(batch.input_ids, expected.input_ids)
    assert torch.equal(batch.token_rewards, expected.token_rewards)


async def test_a_referenced_member_whose_record_is_gone_rejects_its_group_for_every_reader(
    kafka_bootstrap, redis_url
) -> None:
    """The reader-side ``tokens_unavailable`` rule: an accepted verdict naming a record that is not
    its member's trajectory comes out rejected, as the worker would have published it inline."""
    import io
    import json

    from infra.kafka import make_producer
    from infra.readback import VerdictTokens
    from infra.schema import GroupVerdict, SessionResult, TokenRef, encode
    from prm_pipeline.verdict_dump import _dump
    from shaper import VerdictConsumer

    cfg = _reference_config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group(f"refgone-{uuid.uuid4().hex[:6]}", 2, turns=2, output_tokens=(16, 32))
    gid, topic = group[0].group_id, cfg.topics.trajectories
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        value, headers = encode(group[0])
        meta = await producer.send_and_wait(topic, value, key=gid.encode(), headers=headers)
        sessions = [
            SessionResult(
                session_id=t.session_id,
                trajectory_id=t.trajectory_id,
                status="scored",
                stats={"x": 1.0},
                tokens_at=TokenRef(partition=meta.partition, offset=meta.offset),
            )
            for t in group
        ]  # the second member names the first one's record
        verdict = GroupVerdict(group_id=gid, status="accepted", group_size=2, sessions=sessions)
        value, headers = encode(verdict)
        await producer.send_and_wait(cfg.topics.verdicts, value, key=gid.encode(), headers=headers)
    finally:
        await producer.stop()
    reason = (
        f"tokens_unavailable: member {group[1].trajectory_id!r} (session {group[1].session_id!r}): "
        f"record {topic}:{meta.partition}@{meta.offset} could not be read back"
    )
    tokens = VerdictTokens(cfg)
    try:
        resolved = await tokens.resolve_one(verdict)
    finally:
        await tokens.aclose()
    assert resolved.status == "rejected" and resolved.reason == reason and resolved.reason_code == "tokens_unavailable"
    kept, lost = resolved.sessions
    assert kept.status == "scored" and kept.turns == compact_turns(group[0].interactions)
    assert lost.status == "failed" and lost.stats == {} and lost.turns == [] and lost.tokens_at is None
    assert lost.error == f"tokens_unavailable: record {topic}:{meta.partition}@{meta.offset} could not be read back"
    out = io.StringIO()
    await _dump(cfg, out, from_beginning=True, max_count=1, timeout_s=5)
    line = json.loads(out.getvalue())
    assert line["status"] == "rejected" and line["reason"] == reason
    async with VerdictConsumer(
        cfg, batch_groups=1, group_filter=None, device="cpu", group_id=f"trainer-{gid}"
    ) as consumer:
        assert await consumer.next_batch(idle_timeout_s=3) is None  # nothing to train on
        totals = consumer.totals()
    assert totals["pipeline/verdicts/rejected/tokens_unavailable"] == 1, totals


async def test_a_read_back_fetches_the_batch_it_needs_not_the_log_after_it(kafka_bootstrap, redis_url) -> None:
    """Reading one group's members back near the start of a long partition fetches about
    that group's batch: a fetch's byte limit is small, and the broker still returns the
    first batch whole when it alone is larger than the limit (these batches are). Records
    between two wanted groups are skipped with a seek, not fetched."""
    cfg = _config(kafka_bootstrap, redis_url)
    cfg = msgspec.structs.replace(cfg, topics=msgspec.structs.replace(cfg.topics, partitions=1))
    await ensure_topics(cfg.kafka, cfg.topics)
    tag = uuid.uuid4().hex[:6]
    groups = [make_group(f"rb{k}-{tag}", 4, turns=4, output_tokens=(1500, 2000)) for k in range(12)]
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        for group in groups:  # a batch per group, at offsets 4k .. 4k+3 of the one partition
            await pub.publish_many(group)

    async def read_back(*ks: int) -> TrajectoryReader:
        reader = TrajectoryReader(cfg)
        try:
            turns = await reader.read(
                [Wanted(0, 4 * k + i, t.trajectory_id, t.group_id) for k in ks for i, t in enumerate(groups[k])]
            )
        finally:
            await reader.aclose()
        for k in ks:
            for i, t in enumerate(groups[k]):
                assert turns[(0, 4 * k + i, t.trajectory_id)] == compact_turns(t.interactions)
        return reader

    group_bytes = (await read_back(11)).bytes_fetched  # nothing after it: what one group's batch weighs
    assert group_bytes > FETCH_BYTES  # a batch larger than the limit still comes back whole
    first = await read_back(0)  # eleven groups after it in the log
    # its own batch (groups differ in size by at most a third here), not the ~2.7 MB after it
    assert FETCH_BYTES < first.bytes_fetched <= 2 * group_bytes, (first.bytes_fetched, group_bytes)
    # two groups with five between them in one read: the gap is skipped, not read through
    apart = await read_back(2, 8)
    assert apart.bytes_fetched <= 3 * group_bytes, (apart.bytes_fetched, group_bytes)


# --------------------------------------------------------------------------- streamed sessions
async def test_a_streamed_member_is_read_back_from_its_first_turn_to_its_end(kafka_bootstrap, redis_url) -> None:
    """A streamed member names its first ``turn`` record: the reader follows its session through
    the records of others (another session of the group, a ready record, a producer's repeated
    turn) to its ``end``, with the turns its ``ready`` form gives. A session with no end in the
    log, and a wanted offset that is not a session's first turn, cannot be read back."""
    from infra.kafka import make_producer
    from infra.schema import SessionTurn, decode_message, stream_session
    from tests.integration.harness import read_topic

    cfg = _config(kafka_bootstrap, redis_url)
    cfg = msgspec.structs.replace(cfg, topics=msgspec.structs.replace(cfg.topics, partitions=1))
    await ensure_topics(cfg.kafka, cfg.topics)
    gid = f"streamback-{uuid.uuid4().hex[:6]}"
    a, b, c, d = make_group(gid, 4, turns=4, output_tokens=(16, 48))
    (a_turns, a_end), (b_turns, b_end), (d_turns, _) = stream_session(a), stream_session(b), stream_session(d)
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:  # compact per turn, as producers send them
        for message in (a_turns[0], b_turns[0], a_turns[1], d_turns[0], c, *b_turns[1:], b_end, d_turns[1]):
            await pub.publish(message)
        await pub.flush()
        records = await read_topic(cfg, cfg.topics.trajectories)
        repeated = records[2]  # a's second turn, sent again as it was (a producer's retry)
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            await producer.send_and_wait(
                cfg.topics.trajectories, repeated.value, key=repeated.key, headers=list(repeated.headers)
            )
        finally:
            await producer.stop()
        for message in (*a_turns[2:], a_end):
            await pub.publish(message)
    messages = [decode_message(r.value, r.headers, kinds=("ready", "turn", "end")) for r in records]
    assert isinstance(messages[2], SessionTurn) and messages[2].trajectory_id == a.trajectory_id

    def first_turn(traj: ReadyTrajectory) -> int:
        return next(
            r.offset
            for r, m in zip(records, messages)
            if isinstance(m, SessionTurn) and m.trajectory_id == traj.trajectory_id
        )

    reader = TrajectoryReader(cfg)
    try:
        turns = await reader.read(
            [
                Wanted(0, first_turn(a), a.trajectory_id, gid),
                Wanted(0, first_turn(b), b.trajectory_id, gid),
                Wanted(0, first_turn(d), d.trajectory_id, gid),  # never ends
                Wanted(0, records[2].offset, a.trajectory_id, gid),  # a's second turn, not its first
            ]
        )
    finally:
        await reader.aclose()
    assert turns[(0, first_turn(a), a.trajectory_id)] == compact_turns(a.interactions)
    assert turns[(0, first_turn(b), b.trajectory_id)] == compact_turns(b.interactions)
    assert set(turns) == {(0, first_turn(a), a.trajectory_id), (0, first_turn(b), b.trajectory_id)}


async def test_reference_verdicts_name_a_streamed_member_s_first_turn(kafka_bootstrap, redis_url) -> None:
    """With ``reference`` a streamed member's verdict names its first ``turn`` record, and every
    verdict reader reads back the turns its ``ready`` form gives."""
    from infra.readback import VerdictTokens
    from infra.schema import decode_verdict, stream_session
    from tests.integration.harness import read_topic

    cfg = _reference_config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group(f"refstream-{uuid.uuid4().hex[:6]}", 2, turns=3, output_tokens=(64, 128))
    gid = group[0].group_id
    async with running_worker(cfg, "w-ref"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            for traj in group:
                turns, end = stream_session(traj)
                for message in (*turns, end):
                    await pub.publish(message)
        await wait_for_verdicts(cfg, [gid], timeout_s=30)
    (record,) = [r for r in await read_topic(cfg, cfg.topics.verdicts) if r.key == gid.encode()]
    raw = decode_verdict(record.value, record.headers)
    firsts = {}
    for r in await read_topic(cfg, cfg.topics.trajectories):
        firsts.setdefault(msgspec.msgpack.decode(r.value)["trajectory_id"], (r.partition, r.offset))
    assert raw.status == "accepted", raw.reason
    for s in raw.sessions:
        assert s.turns == [] and s.tokens_at is not None
        assert (s.tokens_at.partition, s.tokens_at.offset) == firsts[s.trajectory_id]
    tokens = VerdictTokens(cfg)
    try:
        resolved = await tokens.resolve_one(raw)
    finally:
        await tokens.aclose()
    by_id = {t.trajectory_id: t for t in group}
    assert resolved.status == "accepted"
    for s in resolved.sessions:
        assert s.tokens_at is None and s.turns == compact_turns(by_id[s.trajectory_id].interactions)
