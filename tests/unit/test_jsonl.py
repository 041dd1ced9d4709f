"""JSONL interchange tests: the documented examples parse exactly, and every mistake a
person can make in a hand-written file fails with the field path (and line) named."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from infra import jsonl
from infra.jsonl import JsonlError, dump, load, parse, write
from infra.schema import (
    DiscardGroup,
    Interaction,
    ModelResponse,
    ReadyTrajectory,
    decode_message,
    encode,
)
from prm_pipeline.demo.synthetic import make_group

DOC = Path(__file__).resolve().parents[2] / "docs" / "jsonl.md"

READY: dict[str, Any] = {
    "kind": "ready",
    "trajectory_id": "t1",
    "session_id": "s1",
    "group_id": "g1",
    "group_size": 2,
    "outcome_reward": 1.0,
    "is_eval": False,
    "interactions": [
        {
            "interaction_id": "i1",
            "parent_id": None,
            "messages": [{"role": "user", "content": "hi"}],
            "output_message_list": [{"role": "assistant", "content": "hello"}],
            "input_tokens": [1, 2],
            "output_tokens": [3, 4, 5],
            "output_logprobs": [-0.1, -0.2, -0.3],
            "stop_reason": "stop",
        }
    ],
}
DISCARD: dict[str, Any] = {"kind": "discard", "group_id": "g1", "reason": "env crashed"}


def ready(**overrides: Any) -> dict[str, Any]:
    obj = copy.deepcopy(READY)
    obj.update(overrides)
    return obj


def with_turn(**overrides: Any) -> dict[str, Any]:
    obj = ready()
    obj["interactions"][0].update(overrides)
    return obj


def error(obj: Any) -> str:
    with pytest.raises(JsonlError) as info:
        parse(obj)
    return str(info.value)


def line(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()


# --------------------------------------------------------------------------- happy paths
def test_ready_from_the_doc_example() -> None:
    msg = parse(READY)
    assert isinstance(msg, ReadyTrajectory)
    assert (msg.trajectory_id, msg.session_id, msg.group_id, msg.group_size) == ("t1", "s1", "g1", 2)
    assert (msg.outcome_reward, msg.is_eval, msg.policy_version, msg.created_at) == (1.0, False, None, 0.0)
    (it,) = msg.interactions
    assert (it.interaction_id, it.parent_id, it.reward) == ("i1", None, None)
    assert it.messages == [{"role": "user", "content": "hi"}]
    assert it.output_message_list == [{"role": "assistant", "content": "hello"}]
    mr = it.model_response
    assert mr.input_tokens.dtype == np.dtype("<i4") and mr.input_tokens.tolist() == [1, 2]
    assert mr.output_tokens.tolist() == [3, 4, 5]
    np.testing.assert_array_equal(mr.output_logprobs, np.array([-0.1, -0.2, -0.3], dtype=np.float32))
    assert mr.stop_reason == "stop"


def test_discard_from_the_doc_example() -> None:
    assert parse(DISCARD) == DiscardGroup(group_id="g1", reason="env crashed")
    assert parse({"kind": "discard", "group_id": "g2"}) == DiscardGroup(group_id="g2")


def test_doc_examples_are_the_ones_tested() -> None:
    text = DOC.read_text()
    assert '"output_tokens": [3, 4, 5]' in text and '{"kind": "discard", "group_id": "g1"' in text
    assert "Verdict output (`prm-pipeline verdicts`)" in text


def test_minimal_interaction_uses_defaults() -> None:
    obj = ready(interactions=[{"interaction_id": "i1", "input_tokens": [], "output_tokens": [7]}])
    del obj["is_eval"]
    msg = parse(obj)
    it = msg.interactions[0]
    assert (it.parent_id, it.messages, it.output_message_list, it.reward) == (None, [], [], None)
    assert it.model_response.output_logprobs is None and it.model_response.stop_reason is None
    assert msg.is_eval is False


def test_all_optional_fields() -> None:
    obj = ready(policy_version=4, created_at=1700000000.5, is_eval=True)
    obj["interactions"].append(
        {
            "interaction_id": "i2",
            "parent_id": "i1",
            "input_tokens": [1],
            "output_tokens": [],
            "output_logprobs": [],
            "reward": -0.5,
            "stop_reason": "length",
        }
    )
    msg = parse(obj)
    assert (msg.policy_version, msg.created_at, msg.is_eval) == (4, 1700000000.5, True)
    i2 = msg.interactions[1]
    assert (i2.parent_id, i2.reward, i2.model_response.stop_reason) == ("i1", -0.5, "length")
    assert i2.model_response.output_len == 0


def test_int32_bounds_accepted() -> None:
    mr = parse(with_turn(output_tokens=[2**31 - 1, 0], output_logprobs=None)).interactions[0].model_response
    assert mr.output_tokens.tolist() == [2**31 - 1, 0]


def test_negative_token_id_refused() -> None:
    """Token ids are vocabulary indices: non-negative, as the gateway and the wire require."""
    assert error(with_turn(output_tokens=[3, -1, 5])) == (
        "interactions[0].output_tokens[1]: Expected `int` >= 0 (a token id: int32, non-negative)"
    )


def test_integral_reward_accepted() -> None:
    assert parse(ready(outcome_reward=1)).outcome_reward == 1.0


# --------------------------------------------------------------------------- errors name the path
def test_bad_token_type() -> None:
    assert error(with_turn(output_tokens=[3, "4", 5])) == (
        "interactions[0].output_tokens[1]: Expected `int`, got `str` (a token id: int32, non-negative)"
    )


@pytest.mark.parametrize("bad", [1.0, True, None])
def test_non_integer_token(bad: Any) -> None:
    assert error(with_turn(input_tokens=[1, bad])).startswith("interactions[0].input_tokens[1]: Expected `int`")


def test_tokens_not_a_list() -> None:
    assert error(with_turn(output_tokens="3 4 5")) == (
        "interactions[0].output_tokens: Expected `array`, got `str` (a list of token ids (int32, non-negative))"
    )


def test_token_out_of_int32() -> None:
    msg = error(with_turn(output_tokens=[3, 4, 2**31]))
    assert msg.startswith("interactions[0].output_tokens[2]: Expected `int` <= 2147483647") and "int32" in msg


def test_bad_logprob_type() -> None:
    assert error(with_turn(output_logprobs=[-0.1, "x", -0.3])).startswith(
        "interactions[0].output_logprobs[1]: Expected `float`, got `str`"
    )


def test_logprobs_length_mismatch() -> None:
    assert error(with_turn(output_logprobs=[-0.1])).startswith(
        "interactions[0].output_logprobs: 1 values for 3 output tokens"
    )


def test_logprob_overflowing_float32() -> None:
    assert "finite" in error(with_turn(output_logprobs=[-0.1, -1e39, -0.3]))


def test_missing_trajectory_id() -> None:
    obj = ready()
    del obj["trajectory_id"]
    assert error(obj) == "trajectory_id: missing required field"


def test_missing_tokens() -> None:
    obj = ready()
    del obj["interactions"][0]["output_tokens"]
    assert error(obj) == "interactions[0].output_tokens: missing required field"


def test_empty_id() -> None:
    assert error(ready(session_id="")).startswith("session_id:")
    assert error(with_turn(interaction_id="")).startswith("interactions[0].interaction_id:")


def test_unknown_top_level_key() -> None:
    obj = ready()
    obj["trajetory_id"] = obj.pop("trajectory_id")
    msg = error(obj)
    assert msg == "unknown key `trajetory_id`; did you mean `trajectory_id`?"


def test_unknown_interaction_key() -> None:
    msg = error(with_turn(stop_reasn="stop"))
    assert msg == "interactions[0]: unknown key `stop_reasn`; did you mean `stop_reason`?"


def test_unknown_discard_key() -> None:
    assert "unknown key `resaon`; did you mean `reason`?" in error({"kind": "discard", "group_id": "g", "resaon": "x"})
    assert error({"kind": "discard", "group_id": "g", "zzz": 1}) == (
        "unknown key `zzz`; valid keys: experiment_id, group_id, reason, requested_at"
    )


def test_unknown_kind() -> None:
    assert (
        error(ready(kind="redy")) == "kind: unknown kind 'redy' (expected one of ['ready', 'discard', 'turn', 'end'])"
    )


def test_missing_kind() -> None:
    obj = ready()
    del obj["kind"]
    assert error(obj).startswith("kind: missing required field")


def test_not_an_object() -> None:
    assert error([READY]) == "expected a JSON object, got list"


def test_wrong_scalar_type() -> None:
    assert error(ready(is_eval="no")).startswith("is_eval: Expected `bool`")
    assert error(ready(group_size="2")).startswith("group_size: Expected `int`")


def test_group_size_zero() -> None:
    assert error(ready(group_size=0)).startswith("group_size:")


def test_nan_outcome_reward() -> None:
    assert "outcome_reward must be finite" in error(ready(outcome_reward=math.nan))


def test_nan_turn_reward() -> None:
    assert error(with_turn(reward=math.inf)).startswith("interactions[0]:")


def test_duplicate_interaction_ids() -> None:
    obj = ready()
    obj["interactions"].append(copy.deepcopy(obj["interactions"][0]))
    assert "duplicate interaction_id 'i1'" in error(obj)


def test_unknown_parent() -> None:
    assert "unknown parent_id 'ghost'" in error(with_turn(parent_id="ghost"))


def test_cyclic_parents() -> None:
    obj = ready()
    second = copy.deepcopy(obj["interactions"][0]) | {"interaction_id": "i2", "parent_id": "i1"}
    obj["interactions"][0]["parent_id"] = "i2"
    obj["interactions"].append(second)
    assert "cycle" in error(obj)


def test_empty_interactions() -> None:
    assert "interactions must not be empty" in error(ready(interactions=[]))


def test_errors_are_value_errors() -> None:
    assert issubclass(JsonlError, ValueError)


# --------------------------------------------------------------------------- files
def test_load_reports_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    bad = with_turn(output_tokens=[3, "four", 5])
    path.write_text("\n".join([line(READY), line(DISCARD), line(bad), line(READY)]) + "\n")
    it = load(path)
    assert isinstance(next(it), ReadyTrajectory)
    assert isinstance(next(it), DiscardGroup)
    with pytest.raises(JsonlError) as info:
        next(it)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: interactions[0].output_tokens[1]: Expected `int`, got `str`")
    assert ":3:" in msg


def test_load_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(line(READY) + "\n{not json\n")
    with pytest.raises(JsonlError, match=r"broken\.jsonl:2: invalid JSON"):
        list(load(path))


def test_load_same_messages_as_parse(tmp_path: Path) -> None:
    for obj in (with_turn(stop_reasn="x"), ready(kind="nope"), ready(group_size=0)):
        path = tmp_path / "one.jsonl"
        path.write_text(line(obj) + "\n")
        with pytest.raises(JsonlError) as info:
            list(load(path))
        assert str(info.value) == f"{path}:1: {error(obj)}"


def test_load_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n" + line(READY) + "\n   \n\t\n" + line(DISCARD) + "\n\n")
    assert [type(m) for m in load(path)] == [ReadyTrajectory, DiscardGroup]


def test_load_last_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "nolf.jsonl"
    path.write_text(line(DISCARD))
    assert list(load(path)) == [parse(DISCARD)]


def test_load_is_lazy(tmp_path: Path) -> None:
    path = tmp_path / "lazy.jsonl"
    path.write_text(line(READY) + "\n" + "garbage\n")
    assert isinstance(next(load(path)), ReadyTrajectory)  # line 2 is only read on demand


# --------------------------------------------------------------------------- dump / write
def test_dump_parse_round_trip() -> None:
    obj = ready(policy_version=3, created_at=5.0)
    obj["interactions"].append(
        {"interaction_id": "i2", "parent_id": "i1", "input_tokens": [9], "output_tokens": [8, 7], "reward": 0.5}
    )
    msg = parse(obj)
    dumped = dump(msg)
    assert parse(dumped) == msg
    assert dumped["interactions"][0]["output_tokens"] == [3, 4, 5]
    assert type(dumped["interactions"][0]["output_tokens"][0]) is int
    assert "output_logprobs" not in dumped["interactions"][1]
    assert msgspec.json.decode(msgspec.json.encode(dumped)) == dumped  # plain JSON data
    assert parse(DISCARD) == parse(dump(parse(DISCARD)))


def test_dump_of_doc_example_matches_it() -> None:
    dumped = dump(parse(READY))
    expected = copy.deepcopy(READY)
    del dumped["interactions"][0]["output_logprobs"], expected["interactions"][0]["output_logprobs"]
    assert dumped == expected  # only float32 rounding of logprobs differs


def test_dump_refuses_tokenless_interactions() -> None:
    msg = ReadyTrajectory(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=1,
        outcome_reward=0.0,
        interactions=[Interaction(interaction_id="x")],
    )
    with pytest.raises(JsonlError, match="'x' has no model_response"):
        dump(msg)


def test_write_then_load(tmp_path: Path) -> None:
    big = ReadyTrajectory(
        trajectory_id="t-big",
        session_id="s",
        group_id="g",
        group_size=1,
        outcome_reward=-1.0,
        interactions=[
            Interaction(
                interaction_id="r",
                model_response=ModelResponse.from_arrays(
                    np.arange(100), np.arange(32_768) % 50_000, -np.ones(32_768, np.float32)
                ),
            )
        ],
    )
    messages = [parse(READY), parse(DISCARD), big]
    path = tmp_path / "out.jsonl"
    assert write(path, messages) == 3
    assert path.read_text().count("\n") == 3
    assert list(load(path)) == messages


def test_jsonl_and_wire_agree() -> None:
    msg = parse(READY)
    assert decode_message(*encode(msg)) == msg


def test_public_api() -> None:
    assert set(jsonl.__all__) >= {"JsonlError", "parse", "load", "dump", "write"}


def test_verdict_lines_carry_the_typed_failure_fields() -> None:
    from infra.schema import GroupVerdict, SessionResult

    failed = SessionResult.failure(code="scorer_timeout", detail="TimeoutError", session_id="s", trajectory_id="t")
    scored = SessionResult(session_id="s2", trajectory_id="t2", status="scored")
    line = jsonl.dump_verdict(
        GroupVerdict(group_id="g", status="rejected", reason="scorer_timeout", sessions=[failed, scored])
    )
    first, second = line["sessions"]
    assert (first["error"], first["error_code"], first["error_detail"]) == (
        "scorer_timeout: TimeoutError",
        "scorer_timeout",
        "TimeoutError",
    )
    assert "error_scorer" not in first  # no single scorer failed
    assert not {"error", "error_code", "error_scorer", "error_detail"} & second.keys()


def test_verdict_lines_carry_policy_version_and_reason_code() -> None:
    from infra.schema import GroupVerdict, SessionResult

    member = SessionResult(session_id="s", trajectory_id="t", status="discarded", policy_version=7)
    line = jsonl.dump_verdict(
        GroupVerdict(
            group_id="g", status="discarded", reason="environment crashed", reason_code="discarded", sessions=[member]
        )
    )
    assert (line["reason_code"], line["reason"]) == ("discarded", "environment crashed")
    assert line["sessions"][0]["policy_version"] == 7
    unversioned = jsonl.dump_verdict(
        GroupVerdict(
            group_id="g",
            status="accepted",
            sessions=[SessionResult(session_id="s", trajectory_id="t", status="scored")],
        )
    )
    assert unversioned["sessions"][0]["policy_version"] is None and unversioned["reason_code"] == ""


def test_token_rewards_round_trip_and_length_checked() -> None:
    from infra.jsonl import JsonlError, dump, parse

    line = {
        "kind": "ready",
        "trajectory_id": "t",
        "session_id": "s",
        "group_id": "g",
        "group_size": 1,
        "outcome_reward": 1.0,
        "interactions": [
            {"interaction_id": "a", "input_tokens": [1], "output_tokens": [2, 3], "token_rewards": [0.5, -0.25]}
        ],
    }
    message = parse(line)
    assert message.interactions[0].token_rewards.tolist() == [0.5, -0.25]
    assert dump(message)["interactions"][0]["token_rewards"] == [0.5, -0.25]
    line["interactions"][0]["token_rewards"] = [0.5]
    with pytest.raises(JsonlError, match=r"interactions\[0\].token_rewards: 1 values for 2"):
        parse(line)


def test_doc_lists_every_field_of_a_verdict_line() -> None:
    """docs/jsonl.md's verdict table names every key ``dump_verdict`` writes."""
    from infra.schema import BranchResult, GroupVerdict, PRMTurnResult, SessionResult, TokenRewards

    scored = SessionResult(
        session_id="s",
        trajectory_id="t",
        status="scored",
        policy_version=1,
        error="keep_original",
        branches=[
            BranchResult(
                leaf_id="a",
                path=["a"],
                token_rewards={"a": TokenRewards(length=1, uniform=1.0)},
                scorer_totals={"x": 1.0},
            )
        ],
        turn_results=[PRMTurnResult(interaction_id="a", scorer_name="x", reward=1.0)],
    )
    failed = SessionResult.failure(code="scorer_error", detail="boom", scorer="x", session_id="s2", trajectory_id="t2")
    line = jsonl.dump_verdict(
        GroupVerdict(group_id="g", status="rejected", reason_code="scorer_error", sessions=[scored, failed])
    )
    rows = [row for row in DOC.read_text().split("## Verdict output", 1)[1].splitlines() if row.startswith("| `")]
    top = {row.split("`")[1] for row in rows}
    member_rows = [row.split(" | ")[0] for row in rows if row.startswith("| `sessions[].")]
    missing = [k for k in line if k not in top]
    missing += [
        f"sessions[].{k}"
        for s in line["sessions"]
        for k in s
        if not any(f"`{k}`" in r or f"`sessions[].{k}`" in r or f"`sessions[].{k}[]`" in r for r in member_rows)
    ]
    branch_row = next(r for r in rows if r.startswith("| `sessions[].branches[]`"))
    missing += [f"branches[].{k}" for k in line["sessions"][0]["branches"][0] if f"`{k}`" not in branch_row]
    assert missing == []


def test_a_file_with_a_utf8_byte_order_mark_loads(tmp_path: Path) -> None:
    """What some Windows editors write: the mark is skipped, not "invalid character" at byte 0."""
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    jsonl.write(plain, make_group("bom", 2, turns=1, output_tokens=2))
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert list(jsonl.load(marked)) == list(jsonl.load(plain))
    assert [n for n, _ in jsonl.load_lines(marked)] == [1, 2]


# --------------------------------------------------------------------------- streamed sessions
def _doc_stream() -> list[dict[str, Any]]:
    """The three lines of the doc's streamed-session example, as objects."""
    text = DOC.read_text().split('### `kind: "turn"` and `kind: "end"`', 1)[1].split("```json\n", 1)[1]
    block = text.split("```", 1)[0]
    records, current = [], ""
    for raw in block.splitlines():
        current += raw.strip()
        try:
            records.append(msgspec.json.decode(current))
            current = ""
        except msgspec.DecodeError:
            continue
    return records


def test_the_doc_stream_example_is_the_ready_form_of_one_session() -> None:
    from infra.schema import SessionEnd, SessionTurn, expand_trajectory, streamed_trajectory

    first, second, end = (parse(r) for r in _doc_stream())
    assert isinstance(first, SessionTurn) and isinstance(second, SessionTurn) and isinstance(end, SessionEnd)
    traj = expand_trajectory(streamed_trajectory([first.interaction, second.interaction], end))
    assert [i.interaction_id for i in traj.interactions] == ["i1", "i2"]
    assert traj.interactions[1].model_response.input_tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert (traj.trajectory_id, traj.group_size, traj.outcome_reward) == ("t2", 2, 1.0)
    assert [dump(m) for m in (first, second, end)] == [
        {**r, "interaction": {"output_message_list": [], "messages": [], **r["interaction"]}}
        if r["kind"] == "turn"
        else {**r, "is_eval": False}
        for r in _doc_stream()
    ]


def test_turn_and_end_lines_round_trip_through_dump_and_the_wire(tmp_path: Path) -> None:
    from infra.schema import STREAM_KINDS, SessionEnd, SessionTurn

    turn = SessionTurn(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=3,
        created_at=5.0,
        experiment_id="exp-a",
        interaction=parse(READY).interactions[0],
    )
    end = SessionEnd(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=3,
        outcome_reward=-1.5,
        is_eval=True,
        policy_version=7,
        created_at=6.0,
        turn_count=1,
        experiment_id="exp-a",
    )
    path = tmp_path / "s.jsonl"
    assert write(path, [turn, end]) == 2
    assert list(load(path)) == [turn, end]
    assert [decode_message(*encode(m), kinds=STREAM_KINDS) for m in (turn, end)] == [turn, end]


@pytest.mark.parametrize(
    "patch, expected",
    [
        (
            {"interaction": {"interaction_id": "i", "input_tokens": [1], "output_tokens": [2], "typo": 1}},
            "interaction: unknown key `typo`; valid keys: input_tokens, interaction_id",
        ),
        (
            {"interaction": {"interaction_id": "i", "input_tokens": [1], "output_tokens": ["x"]}},
            "interaction.output_tokens[0]: Expected `int`, got `str`",
        ),
        (
            {"interaction": {"interaction_id": "i", "input_tokens": [1], "output_tokens": [2], "output_logprobs": []}},
            "interaction.output_logprobs: 0 values for 1 output tokens",
        ),
        ({"group_size": 0}, "group_size"),
        ({"session_id": ""}, "session_id"),
        ({"interaction": None}, "interaction"),
    ],
)
def test_turn_line_errors_name_the_field(patch: dict[str, Any], expected: str) -> None:
    obj = {
        "kind": "turn",
        "trajectory_id": "t",
        "session_id": "s",
        "group_id": "g",
        "group_size": 1,
        "interaction": {"interaction_id": "i", "input_tokens": [1], "output_tokens": [2]},
        **patch,
    }
    assert expected in error(obj)


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"turn_count": 0}, "turn_count"),
        ({"outcome_reward": "1"}, "outcome_reward"),
        ({"interactions": []}, "unknown key `interactions`"),
        ({}, "outcome_reward: missing required field"),
    ],
)
def test_end_line_errors_name_the_field(patch: dict[str, Any], expected: str) -> None:
    obj = {"kind": "end", "trajectory_id": "t", "session_id": "s", "group_id": "g", "group_size": 1, **patch}
    if patch and "outcome_reward" not in patch:
        obj["outcome_reward"] = 0.0
    assert expected in error(obj)
