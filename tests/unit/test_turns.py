"""Streamed sessions on the wire: each turn compacted against the session's earlier turns
(:mod:`infra.turns`), and the ``ready`` form rebuilt from turns + end
(:func:`infra.schema.streamed_trajectory`) equal to the session the producer had."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from infra.schema import (
    STREAM_KINDS,
    InvalidMessage,
    ReadyTrajectory,
    SessionEnd,
    SessionTurn,
    UnknownMessageKind,
    compact_trajectory,
    decode_message,
    encode,
    expand_trajectory,
    stream_session,
    streamed_trajectory,
)
from infra.turns import TurnCompactor
from prm_pipeline.demo.synthetic import make_agent_session, make_session


def wire(compactor: TurnCompactor, traj: ReadyTrajectory) -> tuple[list[bytes], ReadyTrajectory]:
    """Send ``traj`` as a streamed session through ``compactor`` and the codec; return the
    turn record values and the session a reader rebuilds from the decoded records."""
    turns, end = stream_session(traj)
    values, received = [], []
    for turn in turns:
        value, headers = encode(compactor.compact(turn))
        values.append(value)
        decoded = decode_message(value, headers, kinds=STREAM_KINDS)
        assert isinstance(decoded, SessionTurn)
        received.append(decoded.interaction)
    compactor.end(end)
    value, headers = encode(end)
    decoded_end = decode_message(value, headers, kinds=STREAM_KINDS)
    assert isinstance(decoded_end, SessionEnd)
    return values, expand_trajectory(streamed_trajectory(received, decoded_end))


def assert_same(a: ReadyTrajectory, b: ReadyTrajectory) -> None:
    assert [i.interaction_id for i in a.interactions] == [i.interaction_id for i in b.interactions]
    for x, y in zip(a.interactions, b.interactions):
        assert (x.parent_id, x.messages, x.output_message_list) == (y.parent_id, y.messages, y.output_message_list)
        assert bytes(x.model_response.input_tokens_raw) == bytes(y.model_response.input_tokens_raw)
        assert x.model_response.output_tokens_raw == y.model_response.output_tokens_raw
        assert x.model_response.output_logprobs_raw == y.model_response.output_logprobs_raw
    for name in (
        "trajectory_id",
        "session_id",
        "group_id",
        "group_size",
        "outcome_reward",
        "is_eval",
        "policy_version",
        "created_at",
        "experiment_id",
    ):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("seed", range(20))
def test_random_sessions_with_branches_round_trip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    turns = int(rng.integers(1, 30))
    branch_at = int(rng.integers(0, turns - 1)) if turns > 2 and rng.random() < 0.5 else None
    traj = make_session(
        trajectory_id=f"t{seed}",
        session_id=f"s{seed}",
        group_id="g",
        group_size=2,
        turns=turns,
        output_tokens=(1, 40),
        branch_at=branch_at,
        rng=rng,
        outcome_reward=float(rng.normal()),
    )
    _, rebuilt = wire(TurnCompactor(), traj)
    assert_same(rebuilt, traj)


def test_each_turn_carries_only_what_is_new() -> None:
    """A 60-turn agent session costs about its compact ``ready`` record in turn records."""
    traj = make_agent_session(
        trajectory_id="t", session_id="s", group_id="g", turns=60, context_tokens=60_000, rng=np.random.default_rng(1)
    )
    values, rebuilt = wire(TurnCompactor(), traj)
    assert_same(rebuilt, traj)
    ready_bytes = len(encode(compact_trajectory(traj))[0])
    assert sum(map(len, values)) < 1.2 * ready_bytes
    assert max(map(len, values)) < 4 * ready_bytes / 60  # no record repeats the history


def test_a_branch_compacts_against_the_turn_it_names() -> None:
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=6, branch_at=2)
    turns, _ = stream_session(traj)
    compactor = TurnCompactor()
    compacted = [compactor.compact(t) for t in turns]
    fork = [t.interaction for t in compacted if t.interaction.parent_id == "s-t2"]
    assert len(fork) == 2 and all(i.shared_tokens and i.shared_messages for i in fork)
    assert compacted[0] is turns[0]  # a root shares nothing


def test_a_re_rendered_history_travels_in_full() -> None:
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=3)
    second = traj.interactions[1]
    mr = second.model_response
    changed = np.array(mr.input_tokens, copy=True)
    changed[0] += 1  # the chat template re-rendered the history
    edited = msgspec.structs.replace(
        second,
        messages=[{"role": "user", "content": "rewritten"}],
        model_response=msgspec.structs.replace(mr, input_tokens_raw=changed.tobytes()),
    )
    traj = msgspec.structs.replace(traj, interactions=[traj.interactions[0], edited, traj.interactions[2]])
    compactor = TurnCompactor()
    turns, _ = stream_session(traj)
    assert compactor.compact(turns[0]) is turns[0] and compactor.compact(turns[1]) is turns[1]
    _, rebuilt = wire(TurnCompactor(), traj)
    assert_same(rebuilt, traj)


def test_a_forgotten_session_sends_full_turns_and_stays_correct() -> None:
    a = make_session(trajectory_id="a", session_id="a", group_id="g", group_size=2, turns=4)
    b = make_session(trajectory_id="b", session_id="b", group_id="g", group_size=2, turns=4)
    compactor = TurnCompactor(max_sessions=1)
    ta, end_a = stream_session(a)
    tb, _ = stream_session(b)
    assert compactor.compact(ta[0]) is ta[0]
    compactor.compact(tb[0])  # evicts a
    assert len(compactor) == 1
    assert compactor.compact(ta[1]) is ta[1]  # parent forgotten: in full
    assert compactor.compact(ta[2]).is_compact  # its parent was remembered again
    rebuilt = expand_trajectory(
        streamed_trajectory(
            [t.interaction for t in ta[:2]] + [compactor.compact(t).interaction for t in ta[2:3]],
            msgspec.structs.replace(end_a, turn_count=3),
        )
    )
    assert bytes(rebuilt.interactions[2].model_response.input_tokens_raw) == bytes(
        a.interactions[2].model_response.input_tokens_raw
    )
    assert len(compactor) == 1  # only a (b was forgotten in turn)
    compactor.end(end_a)
    assert len(compactor) == 0


@pytest.mark.parametrize(
    "case, error",
    [
        ("unknown_parent", "not an earlier turn"),
        ("child_first", "not an earlier turn"),
        ("repeated", "repeated"),
        ("count", "the end says 5 turns, 3 arrived"),
        ("overshare", "shares"),
    ],
)
def test_what_is_not_a_session_is_refused(case: str, error: str) -> None:
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=3)
    turns, end = stream_session(traj)
    compactor = TurnCompactor()
    items = [compactor.compact(t).interaction for t in turns]
    if case == "unknown_parent":
        items[2] = msgspec.structs.replace(items[2], parent_id="nobody", shared_messages=0, shared_tokens=0)
    elif case == "child_first":
        items = [items[1], items[0], items[2]]
    elif case == "repeated":
        items = [items[0], items[1], items[1]]
    elif case == "count":
        end = msgspec.structs.replace(end, turn_count=5)
    else:
        items[1] = msgspec.structs.replace(items[1], shared_tokens=items[1].shared_tokens + 10_000)
    with pytest.raises(InvalidMessage, match=error):
        streamed_trajectory(items, end)


def test_readers_that_do_not_park_turns_refuse_them() -> None:
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=2)
    turns, end = stream_session(traj)
    for message in (turns[0], end):
        with pytest.raises(UnknownMessageKind, match="not one of"):
            decode_message(*encode(message))


def test_a_compact_turn_needs_version_2_and_a_full_one_keeps_version_1() -> None:
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=2)
    turns, end = stream_session(traj)
    compactor = TurnCompactor()
    assert dict(encode(compactor.compact(turns[0]))[1])["prm-schema-version"] == b"1"
    value, headers = encode(compactor.compact(turns[1]))
    assert dict(headers)["prm-schema-version"] == b"2"
    assert dict(encode(end)[1])["prm-schema-version"] == b"1"
    with pytest.raises(InvalidMessage, match="a compact turn"):
        decode_message(value, [("prm-schema-version", b"1"), ("prm-kind", b"turn")], kinds=STREAM_KINDS)


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("group_size", 0, "group_size"),
        ("session_id", "", "session_id"),
        ("turn_count", 0, "turn_count"),
        ("outcome_reward", float("nan"), "outcome_reward"),
        ("experiment_id", "bad id", "experiment"),
    ],
)
def test_end_fields_are_checked(field: str, value: object, error: str) -> None:
    fields = {
        "trajectory_id": "t",
        "session_id": "s",
        "group_id": "g",
        "group_size": 1,
        "outcome_reward": 0.0,
        field: value,
    }
    with pytest.raises(ValueError, match=error):
        SessionEnd(**fields)
