"""Pure logic of the worker's plumbing: Kafka error classes, backoff, the verdict size
fallback, parked-member and group-state decoding, group-commit batching and the token cache."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiokafka import errors as kerr

from infra.kafka import max_record_size, record_size
from infra.retry import backoff_delay, is_permanent, is_retriable
from infra.schema import GroupVerdict, SessionResult, TokenRef, compact_turns, encode
from prm_pipeline.demo.synthetic import make_group
from scoring_workers.batching import Batcher
from scoring_workers.ledger import GroupState, ParkedMember, decode_parked, decode_state, fingerprint
from scoring_workers.verdicts import assemble_verdict, fit_verdict, too_large_verdict


@pytest.mark.parametrize(
    "exc",
    [
        kerr.KafkaConnectionError(),
        kerr.NotLeaderForPartitionError(),
        kerr.RequestTimedOutError(),
        kerr.KafkaTimeoutError(),
        kerr.NodeNotReadyError(),
        ConnectionResetError(),
        OSError("network down"),
    ],
)
def test_outages_are_retriable(exc: BaseException) -> None:
    assert is_retriable(exc) and not is_permanent(exc)


@pytest.mark.parametrize(
    "exc",
    [
        kerr.MessageSizeTooLargeError(),
        kerr.InvalidTopicError(),
        kerr.TopicAuthorizationFailedError(),
        kerr.UnsupportedVersionError(),
        kerr.SaslAuthenticationFailed(),
        kerr.IllegalStateError(),
    ],
)
def test_what_no_retry_can_fix_is_permanent(exc: BaseException) -> None:
    assert is_permanent(exc) and not is_retriable(exc)


def test_backoff_is_bounded_and_jittered() -> None:
    assert backoff_delay(1, jitter=False) == pytest.approx(0.2)
    assert backoff_delay(50, jitter=False) == 10.0
    assert all(5.0 <= backoff_delay(50) <= 10.0 for _ in range(100))


def test_record_size_counts_key_and_headers() -> None:
    assert record_size(b"k" * 100, b"v", [("h", b"x" * 100)]) > record_size(None, b"v", None) + 200


def _scored_group(n: int = 3) -> tuple[list, list[SessionResult]]:
    group = make_group("g-big", n, turns=2, output_tokens=64)
    members = [
        SessionResult(
            session_id=t.session_id,
            trajectory_id=t.trajectory_id,
            status="scored",
            stats={"rollout/x": 1.0},
            turns=compact_turns(t.interactions),
        )
        for t in group
    ]
    return group, members


def test_too_large_verdict_keeps_stats_and_drops_turns_deterministically() -> None:
    _, members = _scored_group()
    verdict = assemble_verdict("g-big", GroupState(group_size=3, decision="complete", decided_at=5), members)
    assert verdict.status == "accepted"
    small = too_large_verdict(verdict, size=123_456, limit=65_536)
    assert small == too_large_verdict(verdict, size=123_456, limit=65_536)  # a pure function: same bytes
    assert (small.status, small.reason_code) == ("rejected", "verdict_too_large")
    assert "123456 bytes" in small.reason and "max_message_bytes=65536" in small.reason
    assert "it was accepted" in small.reason
    assert all(s.turns == [] and s.stats == {"rollout/x": 1.0} for s in small.sessions)
    assert len(encode(small)[0]) < len(encode(verdict)[0]) / 4


def test_a_verdict_too_large_with_turns_names_its_members_records_when_refs_are_given() -> None:
    """``worker.verdict_tokens: auto``: a verdict that fits stays inline (the same bytes as
    ``inline``); one that does not names each scored member's record, accepted; without refs
    (``inline``) or when even that does not fit, ``verdict_too_large``."""
    _, members = _scored_group()
    verdict = assemble_verdict("g-big", GroupState(group_size=3, decision="complete", decided_at=5), members)
    refs = {m.trajectory_id: TokenRef(partition=1, offset=10 + i) for i, m in enumerate(members)}
    size = record_size(b"g-big", *encode(verdict))
    limit = _limit_fitting(size)  # the smallest kafka.max_message_bytes under which the record is safe
    assert fit_verdict(verdict, limit, refs) == fit_verdict(verdict, limit) == (verdict, *encode(verdict))  # it fits
    referenced, value, headers = fit_verdict(verdict, limit - 1, refs)
    assert referenced.status == "accepted" and referenced.reason_code == ""
    assert [(s.turns, s.tokens_at) for s in referenced.sessions] == [([], refs[m.trajectory_id]) for m in members]
    assert [s.branches for s in referenced.sessions] == [m.branches for m in members]
    assert (value, headers) == encode(referenced) and record_size(b"g-big", value, headers) < size / 4
    assert fit_verdict(verdict, limit - 1, refs)[1] == value  # a pure function: every publisher sends these bytes
    assert fit_verdict(verdict, limit - 1)[0].reason_code == "verdict_too_large"  # inline
    ref_limit = _limit_fitting(record_size(b"g-big", value, headers))
    assert fit_verdict(verdict, ref_limit - 1, refs)[0].reason_code == "verdict_too_large"


def test_a_verdict_sized_to_the_limit_itself_is_not_published_as_is() -> None:
    """The broker checks the compressed batch: a record of exactly ``kafka.max_message_bytes``
    can be refused, so :func:`fit_verdict` keeps to :func:`infra.kafka.max_record_size`."""
    _, members = _scored_group()
    verdict = assemble_verdict("g-big", GroupState(group_size=3, decision="complete", decided_at=5), members)
    size = record_size(b"g-big", *encode(verdict))
    small = fit_verdict(verdict, size)[0]
    assert small.reason_code == "verdict_too_large"
    assert (
        f"the verdict is {size} bytes, over the {max_record_size(size)} a record may have under "
        f"kafka.max_message_bytes={size}" in small.reason
    )


def _limit_fitting(size: int) -> int:
    """The smallest ``kafka.max_message_bytes`` whose :func:`infra.kafka.max_record_size` is ``size`` or more."""
    limit = size
    while max_record_size(limit) < size:
        limit += 1
    return limit


def test_parked_members_carry_no_turns() -> None:
    _, members = _scored_group(1)
    parked = ParkedMember(msgspec.structs.replace(members[0], turns=[]), 3, 17)
    assert decode_parked(msgspec.msgpack.encode(parked)) == parked
    verdict = assemble_verdict("g", GroupState(group_size=1), [parked])
    assert isinstance(verdict, GroupVerdict) and verdict.sessions[0].turns == []


def test_group_state_decodes_typed_and_keeps_the_scorers_blob_as_bytes() -> None:
    from infra.schema import ScorerInfo
    from scoring_workers.verdicts import encode_scorers

    scorers = encode_scorers([ScorerInfo("judge", "1.0")])  # msgpack: starts 0x91, not UTF-8
    with pytest.raises(UnicodeDecodeError):
        scorers.decode()
    flat = [
        b"status",
        b"decided",
        b"group_size",
        b"3",
        b"first_seen",
        b"1000",
        b"deadline",
        b"601000",
        b"size_mismatch",
        b"2",
        b"decision",
        b"failed",
        b"decided_at",
        b"1500",
        b"decided_by",
        b"w1",
        b"discard_reason",
        b"",
        b"scorers",
        scorers,
        b"from_a_newer_worker",
        b"ignored",
    ]
    state = decode_state(flat)
    assert state == GroupState(
        status="decided",
        group_size=3,
        first_seen=1000,
        deadline=601000,
        size_mismatch=2,
        decision="failed",
        decided_at=1500,
        decided_by="w1",
        scorers=scorers,
    )
    verdict = assemble_verdict("g", state, [])
    assert [s.name for s in verdict.scorers] == ["judge"] and verdict.timings == {"group_open_s": 0.5}
    assert decode_state([b"status", b"open", b"group_size", b"2"]).decision is None
    with pytest.raises(ValueError, match="decision"):
        decode_state([b"status", b"decided", b"decision", b"maybe"])


def test_a_failed_member_rejects_the_group_naming_it() -> None:
    ok = SessionResult(session_id="s-ok", trajectory_id="t-ok", status="scored", stats={"rollout/x": 1.0})
    bad = SessionResult.failure(
        code="not_concat_export", detail="turn 2 does not extend turn 1", session_id="s-bad", trajectory_id="t-bad"
    )
    verdict = assemble_verdict("g", GroupState(group_size=3, decision="failed"), [ok, bad])
    assert (verdict.status, verdict.reason_code) == ("rejected", "not_concat_export")
    assert verdict.reason == "not_concat_export: member 't-bad' (session 's-bad'): turn 2 does not extend turn 1"
    assert {s.trajectory_id: s.stats for s in verdict.sessions} == {"t-bad": {}, "t-ok": {"rollout/x": 1.0}}
    worse = SessionResult.failure(code="scorer_error", detail="boom", session_id="s-a", trajectory_id="t-a")
    verdict = assemble_verdict("g", GroupState(group_size=3, decision="failed"), [ok, bad, worse])
    assert verdict.reason_code == "scorer_error"
    assert verdict.reason == "scorer_error: member 't-a' (session 's-a'): boom; 1 more member(s) failed"


def test_fingerprints_are_12_bytes_and_stable() -> None:
    assert fingerprint("g-1") == fingerprint("g-1") != fingerprint("g-2")
    assert len(fingerprint("g-1")) == 12


async def test_group_commit_batches_concurrent_submissions() -> None:
    batches: list[list[int]] = []
    gate = asyncio.Event()

    async def run(items: list[int]) -> list[int]:
        batches.append(items)
        await gate.wait()
        return [i * 10 for i in items]

    commit: Batcher[int, int] = Batcher(run)
    first = asyncio.create_task(commit.submit(1))
    await asyncio.sleep(0)  # the first batch is on the wire
    rest = [asyncio.create_task(commit.submit(i)) for i in (2, 3, 4)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(first, *rest) == [10, 20, 30, 40]
    assert batches == [[1], [2, 3, 4]]  # the three that queued meanwhile went as one call


async def test_group_commit_lingering_items_wait_for_company_or_their_time() -> None:
    batches: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        batches.append(items)
        return [i * 10 for i in items]

    commit: Batcher[int, int] = Batcher(run)
    waiting = [asyncio.create_task(commit.submit(i, linger_s=600)) for i in (1, 2)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert batches == [] and not any(t.done() for t in waiting)  # nothing urgent yet: they wait
    assert await commit.submit(3) == 30  # urgent: goes at once, and takes the waiting ones along
    assert await asyncio.gather(*waiting) == [10, 20]
    assert batches == [[1, 2, 3]]
    # alone, a lingering item goes when its wait is over (here: at once)
    assert await asyncio.wait_for(commit.submit(4, linger_s=0.001), 30) == 40
    # closing the ledger fails a lingering item rather than leaving its submitter waiting
    stranded = asyncio.create_task(commit.submit(5, linger_s=600))
    await asyncio.sleep(0)
    await commit.aclose()
    with pytest.raises(ConnectionError):
        await stranded


async def test_group_commit_fails_every_member_of_a_failed_batch() -> None:
    async def run(items: list[int]) -> list[int]:
        raise ConnectionError("redis down")

    commit: Batcher[int, int] = Batcher(run)
    results = await asyncio.gather(commit.submit(1), commit.submit(2), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)


def test_token_cache_is_bounded_and_forgets_finished_groups() -> None:
    from infra.config import PipelineConfig, WorkerConfig
    from scoring_workers.tokens import MemberTokens

    group, members = _scored_group(3)
    one = sum(
        len(t.prompt_delta_raw) + len(t.output_tokens_raw) + len(t.output_logprobs_raw or b"") for t in members[0].turns
    )
    cache = MemberTokens(PipelineConfig(worker=WorkerConfig(token_cache_bytes=int(one * 2.5))))
    for m in members:
        cache.remember("g-big", m.trajectory_id, m.turns)
    assert ("g-big", members[0].trajectory_id) not in cache._cache
    assert cache._bytes <= cache.max_bytes
    cache.forget_group("g-big")
    assert cache._bytes == 0 and not cache._cache


async def test_a_dead_letter_kafka_refuses_for_good_is_counted_as_poison_not_retried() -> None:
    from aiokafka.structs import ConsumerRecord

    from infra.config import PipelineConfig
    from infra.schema import InvalidMessage
    from scoring_workers.worker import Worker

    class RefusingProducer:  # the control flow under test is the worker's, not Kafka's
        calls = 0

        async def send_and_wait(self, *args: object, **kwargs: object) -> None:
            RefusingProducer.calls += 1
            raise kerr.TopicAuthorizationFailedError()

    worker = Worker(PipelineConfig(), worker_id="w-unit")
    worker._attach(None, RefusingProducer())  # type: ignore[arg-type]
    record = ConsumerRecord("traj", 2, 41, 0, 0, None, b"junk", None, 4, [], [])
    await worker.settler.dead_letter(record, InvalidMessage("truncated"), 1)
    assert RefusingProducer.calls == 1
    assert worker.telemetry.snapshot()["prm_worker_poison_total"] == 1.0


def test_capped_dead_letter_fits_with_absurd_headers_and_key() -> None:
    from aiokafka.structs import ConsumerRecord

    from infra.schema import dead_letter_headers
    from scoring_workers.dead_letters import capped_letter

    limit = 64 * 1024
    headers = [(f"h{i}", b"x" * 1000) for i in range(40)]  # 40 KB of headers
    record = ConsumerRecord("traj", 0, 7, 0, 0, b"k" * 30_000, b"v" * 60_000, None, 30_000, 60_000, headers)
    letter, key = capped_letter(
        record, ValueError("bad"), 1, worker_id="w", max_message_bytes=limit, dead_letter_max_bytes=limit
    )
    assert record_size(key, letter.payload, dead_letter_headers(letter)) <= max_record_size(limit) < limit
    assert letter.original_size == 60_000 and letter.payload == b"v" * len(letter.payload)
    assert "dropped" in letter.original_headers and len(key) <= limit // 4


def test_the_scripts_argument_table_matches_the_typed_arguments() -> None:
    """The Lua's per-op ARGV counts are built from the typed argument structs."""
    from scoring_workers.ledger_scripts import ARGS, LEDGER, DecideArgs, FinishArgs, Op, ParkArgs, argv

    assert ARGS == {
        "k": 1 + len(ParkArgs.__struct_fields__),
        "d": 1 + len(DecideArgs.__struct_fields__),
        "f": 1 + len(FinishArgs.__struct_fields__),
    }
    assert f"local ARGS = {{k = {ARGS['k']}, d = {ARGS['d']}, f = {ARGS['f']}}}" in LEDGER
    assert argv(Op.FINISH, FinishArgs(b"fp", 0, "g")) == ["f", b"fp", 0, "g"]
