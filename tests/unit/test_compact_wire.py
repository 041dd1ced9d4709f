"""The compact trajectory form (schema version 2) and chunk records: pure logic, no broker.

Long agent sessions used to travel with every turn's whole conversation and prompt, so
a record grew with the square of the turns. These tests pin the compact form: it
round-trips exactly (chains, branches, re-rendered histories), stays within 1.2x of the
session's content, is refused where a version-1 reader would misread it, and records too
large for one Kafka message are chunked and reassembled.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from infra.chunks import ChunkAssembler, IncompleteTrajectory, reassembled, to_records
from infra.kafka import MessageTooLarge, record_size
from infra.schema import (
    KIND_HEADER,
    MAX_CHUNKS,
    SCHEMA_HEADER,
    Interaction,
    InvalidMessage,
    ModelResponse,
    NotConcatExport,
    ReadyTrajectory,
    TrajectoryChunk,
    check_expandable,
    compact_trajectory,
    compact_turns,
    decode_message,
    encode,
    expand_trajectory,
    expand_turns,
)
from prm_pipeline.demo.synthetic import make_agent_session, make_session, session_content_bytes

LIMIT = 1_048_576  # kafka.max_message_bytes, the default


def agent(turns: int, context: int, **kw) -> ReadyTrajectory:
    return make_agent_session(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        turns=turns,
        context_tokens=context,
        rng=np.random.default_rng(turns),
        **kw,
    )


def tokens(it: Interaction) -> tuple[list[int], list[int]]:
    mr = it.model_response
    return mr.input_tokens.tolist(), mr.output_tokens.tolist()


def assert_same(a: ReadyTrajectory, b: ReadyTrajectory) -> None:
    assert [i.interaction_id for i in a.interactions] == [i.interaction_id for i in b.interactions]
    for x, y in zip(a.interactions, b.interactions):
        assert (x.parent_id, x.messages, x.output_message_list) == (y.parent_id, y.messages, y.output_message_list)
        assert tokens(x) == tokens(y)
        assert x.model_response.output_logprobs_raw == y.model_response.output_logprobs_raw
        assert (x.shared_messages, x.shared_tokens) == (0, 0) == (y.shared_messages, y.shared_tokens)


# --------------------------------------------------------------------------- the form
def test_a_chain_stores_each_turn_once_and_round_trips() -> None:
    full = agent(12, 12_000)
    compact = compact_trajectory(full)
    root, *rest = compact.interactions
    assert (root.shared_messages, root.shared_tokens) == (0, 0)
    for parent, it in zip(compact.interactions, rest):
        full_parent = next(i for i in full.interactions if i.interaction_id == parent.interaction_id)
        pmr = full_parent.model_response
        assert it.shared_tokens == pmr.input_len + pmr.output_len  # the concat-export delta
        assert it.shared_messages == len(full_parent.messages) + len(full_parent.output_message_list)
        assert len(it.messages) == 1  # just the tool's answer
    value, headers = encode(compact)
    assert dict(headers)[SCHEMA_HEADER] == b"2"
    assert_same(decode_message(value, headers), full)
    assert encode(decode_message(value, headers, expand=False))[0] == value  # the wire form, byte for byte


def test_a_branching_session_round_trips() -> None:
    full = agent(10, 10_000, branch_at=4)
    leaves = {i.interaction_id for i in full.interactions} - {i.parent_id for i in full.interactions}
    assert len(leaves) == 2
    compact = compact_trajectory(full)
    fork = [i for i in compact.interactions if i.parent_id == "s-t4"]
    assert len(fork) == 2 and all(i.shared_tokens > 0 for i in fork)
    assert_same(decode_message(*encode(compact)), full)


def test_a_re_rendered_history_is_representable_not_refused() -> None:
    """A turn whose prompt is not its parent's prompt + output shares what still matches —
    down to nothing (a full prompt) — and decodes exactly."""
    root = Interaction(
        interaction_id="a",
        messages=[{"role": "user", "content": "q"}],
        output_message_list=[{"role": "assistant", "content": "<think>x</think>y"}],
        model_response=ModelResponse.from_arrays([1, 2, 3], [4, 5, 6]),
    )
    stripped = Interaction(
        interaction_id="b",
        parent_id="a",  # history re-rendered: thinking dropped
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "y"},
            {"role": "user", "content": "more"},
        ],
        model_response=ModelResponse.from_arrays([1, 2, 3, 6, 9], [7]),
    )
    fresh = Interaction(
        interaction_id="c",
        parent_id="b",
        messages=[{"role": "system", "content": "new"}],
        model_response=ModelResponse.from_arrays([42, 43], [8]),
    )
    full = ReadyTrajectory(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=1,
        interactions=[root, stripped, fresh],
        outcome_reward=0.0,
    )
    compact = compact_trajectory(full)
    _, b, c = compact.interactions
    assert (b.shared_messages, b.shared_tokens) == (1, 3) and b.model_response.input_tokens.tolist() == [6, 9]
    assert (c.shared_messages, c.shared_tokens) == (0, 0) and c.model_response.input_tokens.tolist() == [42, 43]
    assert_same(decode_message(*encode(compact)), full)


def test_expanded_prompts_of_a_chain_share_one_buffer() -> None:
    """Memory stays linear: turn k's prompt is a view of the same buffer as turn k+1's."""
    full = agent(30, 30_000)
    expanded = decode_message(*encode(compact_trajectory(full)))
    buffers = {id(i.model_response.input_tokens_raw.obj) for i in expanded.interactions}
    assert len(buffers) == 1
    (buffer,) = {i.model_response.input_tokens_raw.obj for i in expanded.interactions}
    last = expanded.interactions[-1].model_response
    assert len(buffer) == len(last.input_tokens_raw) + len(last.output_tokens_raw)


def test_verdict_turns_and_record_turns_expand_the_same_way() -> None:
    full = agent(8, 8_000, branch_at=3)
    decoded = decode_message(*encode(compact_trajectory(full)))
    turns = compact_turns(decoded.interactions)
    assert turns == compact_turns(full.interactions)
    rebuilt = {i.interaction_id: tokens(i) for i in expand_turns(turns)}
    assert rebuilt == {i.interaction_id: tokens(i) for i in full.interactions}
    # a compact trajectory given straight to compact_turns is expanded first
    assert compact_turns(compact_trajectory(full).interactions) == turns


def test_turns_of_the_wire_form_need_no_prefix_comparison(monkeypatch) -> None:
    """The worker takes token turns from the compact record: when every child shares its
    parent's whole context they are its stored deltas — no expansion, no comparison — and
    equal the turns of the expanded form. A re-rendered history still gets the full check."""
    import infra.schema

    full = agent(8, 8_000, branch_at=3)
    compact = compact_trajectory(full)
    expected = compact_turns(full.interactions)

    def no_compare(*_: object) -> bool:
        raise AssertionError("prompts compared")

    monkeypatch.setattr(infra.schema, "same_bytes", no_compare)
    monkeypatch.setattr(infra.schema, "expand_trajectory_interactions", no_compare)
    assert compact_turns(compact.interactions) == expected
    monkeypatch.undo()
    root, child = agent(2, 2_000).interactions
    shorter = compact_trajectory(
        ReadyTrajectory(  # the child shares less than its parent's whole context
            trajectory_id="t",
            session_id="s",
            group_id="g",
            group_size=1,
            outcome_reward=0.0,
            interactions=[
                root,
                msgspec.structs.replace(
                    child,
                    model_response=msgspec.structs.replace(
                        child.model_response, input_tokens_raw=root.model_response.input_tokens_raw + b"\x07\0\0\0"
                    ),
                ),
            ],
        )
    )
    assert 0 < shorter.interactions[1].shared_tokens < root.model_response.input_len + root.model_response.output_len
    with pytest.raises(NotConcatExport):
        compact_turns(shorter.interactions)


@pytest.mark.parametrize(
    ("turn", "field", "value"), [(1, "shared_tokens", 10**6), (1, "shared_messages", 99), (2, "shared_tokens", 10**6)]
)
def test_check_expandable_refuses_what_expansion_refuses(turn: int, field: str, value: int) -> None:
    raw, headers = _raw(compact_trajectory(agent(3, 3_000)))
    raw["interactions"][turn][field] = value
    value_bytes = msgspec.msgpack.encode(raw)
    with pytest.raises(InvalidMessage) as expanding:
        decode_message(value_bytes, headers)
    wire = decode_message(value_bytes, headers, expand=False)
    with pytest.raises(InvalidMessage) as checking:
        check_expandable(wire)
    assert str(checking.value) == str(expanding.value)
    check_expandable(compact_trajectory(agent(3, 3_000)))  # a sound one passes


def test_full_form_records_keep_version_1_and_their_bytes() -> None:
    single = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=1)
    assert compact_trajectory(single) is single
    value, headers = encode(single)
    assert dict(headers)[SCHEMA_HEADER] == b"1"
    assert b"shared_" not in value
    assert expand_trajectory(single) is single


# --------------------------------------------------------------------------- refusals
def _raw(traj: ReadyTrajectory) -> tuple[dict, list[tuple[str, bytes]]]:
    value, headers = encode(traj)
    return msgspec.msgpack.decode(value), headers


def test_a_compact_record_under_a_version_1_header_is_refused() -> None:
    value, _ = encode(compact_trajectory(agent(3, 3_000)))
    with pytest.raises(InvalidMessage, match="needs prm-schema-version: 2, the record says 1"):
        decode_message(value, [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"ready")])


@pytest.mark.parametrize(
    ("turn", "field", "value", "error"),
    [
        (1, "shared_tokens", 10**6, "whose context has only"),
        (1, "shared_messages", 99, "whose context has only"),
        (0, "shared_tokens", 1, "a root shares nothing"),
        (1, "shared_tokens", -1, ">= 0"),
    ],
)
def test_impossible_sharing_is_refused(turn: int, field: str, value: int, error: str) -> None:
    raw, headers = _raw(compact_trajectory(agent(3, 3_000)))
    raw["interactions"][turn][field] = value
    with pytest.raises(InvalidMessage, match=error):
        decode_message(msgspec.msgpack.encode(raw), headers)


# --------------------------------------------------------------------------- size
@pytest.mark.parametrize(("turns", "context"), [(8, 8_000), (40, 40_000), (100, 128_000)])
def test_compact_record_is_within_1_2x_of_the_content(turns: int, context: int) -> None:
    full = agent(turns, context)
    size = len(encode(compact_trajectory(full))[0])
    assert size <= 1.2 * session_content_bytes(full)
    assert len(encode(full)[0]) > turns / 3 * size  # the full form grew with the square of the turns


def test_a_60_turn_60k_session_is_one_record_under_the_default_limit() -> None:
    (record,) = to_records(agent(60, 60_000), LIMIT)
    assert record_size(b"g", *record) <= LIMIT


def test_a_100_turn_128k_session_is_chunked_and_reassembles() -> None:
    full = agent(100, 128_000, branch_at=70)
    records = to_records(full, LIMIT)
    assert len(records) >= 2
    assembler: ChunkAssembler[int] = ChunkAssembler()
    done = []
    for offset, (value, headers) in enumerate(records):
        assert record_size(b"g", value, headers) <= LIMIT
        assert dict(headers)[KIND_HEADER] == b"chunk" and dict(headers)[SCHEMA_HEADER] == b"2"
        chunk = decode_message(value, headers)
        assert isinstance(chunk, TrajectoryChunk) and (chunk.index, chunk.count) == (offset, len(records))
        done += assembler.add("p0", chunk, offset)
    (whole,) = done
    assert whole.coords == list(range(len(records)))
    assert_same(reassembled(whole), full)


def test_a_session_beyond_the_chunk_limit_is_one_line_naming_it() -> None:
    big = agent(40, 40_000)
    with pytest.raises(MessageTooLarge) as err:
        to_records(big, 1024)
    text = str(err.value)
    assert "\n" not in text
    for part in (
        "session 's'",
        "trajectory 't'",
        "group 'g'",
        "over 40 turns",
        "kafka.max_message_bytes=1024",
        f"{MAX_CHUNKS} chunks",
        " bytes in compact form",
    ):
        assert part in text


# --------------------------------------------------------------------------- reassembly
def _chunks(limit: int = 8192) -> tuple[ReadyTrajectory, list[TrajectoryChunk]]:
    full = agent(6, 6_000)
    return full, [decode_message(v, h) for v, h in to_records(full, limit)]


def test_duplicated_chunks_are_harmless() -> None:
    full, chunks = _chunks()
    assembler: ChunkAssembler[int] = ChunkAssembler()
    assert assembler.add("p", chunks[0], 10) == []
    assert assembler.add("p", chunks[0], 11) == []  # a producer retry
    done = []
    for i, c in enumerate(chunks[1:], start=12):
        done += assembler.add("p", c, i)
    (whole,) = done
    assert whole.coords[:2] == [10, 11] and len(assembler) == 0
    assert_same(reassembled(whole), full)


def test_scopes_are_separate_and_dropping_one_forgets_its_partials() -> None:
    _, chunks = _chunks()
    assembler: ChunkAssembler[int] = ChunkAssembler()
    assembler.add("p0", chunks[0], 0)
    assembler.add("p1", chunks[0], 0)
    assembler.drop(["p0"])
    assert len(assembler) == 1
    assert assembler.add("p0", chunks[-1], 5) == []  # p0 starts over


def test_chunks_that_stop_arriving_are_given_up_after_the_deadline() -> None:
    now = [0.0]
    _, chunks = _chunks()
    assembler: ChunkAssembler[int] = ChunkAssembler(clock=lambda: now[0])
    assembler.add("p", chunks[0], 7)
    assert assembler.expire(30.0) == []
    now[0] = 31.0
    (gone,) = assembler.expire(30.0)
    assert gone.coords == [7]
    with pytest.raises(IncompleteTrajectory, match=f"only 1 of its {len(chunks)} chunks arrived within 30s"):
        reassembled(gone)


def test_a_republication_with_another_size_supersedes_the_partial_one() -> None:
    _, chunks = _chunks()
    other = msgspec.structs.replace(chunks[0], total_bytes=chunks[0].total_bytes + 1)
    assembler: ChunkAssembler[int] = ChunkAssembler()
    assembler.add("p", chunks[0], 0)
    (superseded,) = assembler.add("p", other, 1)
    assert superseded.coords == [0] and "superseded" in superseded.error


def test_chunk_rules_are_checked_on_decode() -> None:
    _, chunks = _chunks()
    value, headers = encode(chunks[0])
    raw = msgspec.msgpack.decode(value)
    raw["index"] = raw["count"]
    with pytest.raises(InvalidMessage, match="chunk index"):
        decode_message(msgspec.msgpack.encode(raw), headers)
    with pytest.raises(InvalidMessage, match="a chunk needs prm-schema-version: 2"):
        decode_message(value, [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"chunk")])


async def test_scoring_a_compact_trajectory_scores_its_full_turns() -> None:
    """Built in process (not decoded), a compact trajectory is expanded before scorers see it."""
    from scoring_workers.prm import PRMConfig, PRMRunner
    from scoring_workers.scoring import score_member
    from tests.scorers import TokenEchoScorer

    full = agent(6, 3_000, branch_at=2)
    runner = await PRMRunner.create(PRMConfig(scorers=[TokenEchoScorer()]))  # type: ignore[list-item]
    try:
        want = await score_member(runner, full, timeout_s=None, scored_at=0)
        got = await score_member(runner, compact_trajectory(full), timeout_s=None, scored_at=0)
    finally:
        await runner.aclose()
    assert got.status == "scored" and got.branches == want.branches and got.turns == want.turns
