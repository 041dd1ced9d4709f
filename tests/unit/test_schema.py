"""Wire-schema tests: round-trips, zero-copy views, and every decode failure mode.

Each failure must surface as the right :class:`SchemaError` subclass with a message
that says what went wrong, because that message is what lands in the dead-letter
headers an operator reads.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from infra.schema import (
    KIND_HEADER,
    SCHEMA_HEADER,
    BranchResult,
    DeadLetter,
    DiscardGroup,
    GroupVerdict,
    Interaction,
    InvalidMessage,
    ModelResponse,
    PRMMetricObservation,
    PRMTurnResult,
    ReadyTrajectory,
    SchemaError,
    ScorerInfo,
    SessionResult,
    TokenRewards,
    TokenTurn,
    UnknownMessageKind,
    UnknownSchemaVersion,
    dead_letter_from_record,
    dead_letter_headers,
    decode_message,
    decode_verdict,
    encode,
    pack_array,
    to_tensor,
)


# --------------------------------------------------------------------------- builders
def turn(iid: str, parent: str | None = None, n_out: int = 3, *, logprobs: bool = True) -> Interaction:
    out = np.arange(10, 10 + n_out, dtype=np.int32)
    return Interaction(
        interaction_id=iid,
        parent_id=parent,
        messages=[{"role": "user", "content": f"q-{iid}"}],
        output_message_list=[{"role": "assistant", "content": f"a-{iid}"}],
        model_response=ModelResponse.from_arrays(
            [1, 2], out, -np.linspace(0.1, 1.0, n_out, dtype=np.float32) if logprobs else None
        ),
    )


def trajectory(*interactions: Interaction, **kw: Any) -> ReadyTrajectory:
    fields: dict[str, Any] = dict(trajectory_id="t1", session_id="s1", group_id="g1", group_size=2, outcome_reward=1.0)
    fields.update(kw)
    return ReadyTrajectory(interactions=list(interactions or [turn("i1")]), **fields)


def raw_trajectory(**overrides: Any) -> dict[str, Any]:
    """A valid ready message as a plain msgpack-able dict (bytes kept as bytes), so
    tests can break one field and check what the *decoder* says."""
    raw = msgspec.to_builtins(trajectory(turn("i1"), turn("i2", "i1")), builtin_types=(bytes,))
    raw["kind"] = "ready"
    raw.update(overrides)
    return raw


def headers(kind: str = "ready", version: str = "1") -> list[tuple[str, bytes]]:
    return [(SCHEMA_HEADER, version.encode()), (KIND_HEADER, kind.encode())]


def decode_raw(raw: dict[str, Any], kind: str = "ready") -> Any:
    return decode_message(msgspec.msgpack.encode(raw), headers(kind))


# --------------------------------------------------------------------------- round-trips
class TestRoundTrip:
    def test_ready_trajectory(self) -> None:
        msg = trajectory(turn("i1"), turn("i2", "i1"), turn("i3", "i1"), policy_version=7, is_eval=True)
        value, hdrs = encode(msg)
        assert dict(hdrs) == {SCHEMA_HEADER: b"1", KIND_HEADER: b"ready"}
        back = decode_message(value, hdrs)
        assert back == msg
        mr = back.interactions[1].model_response
        assert mr.output_tokens.tolist() == [10, 11, 12]
        assert mr.input_tokens.tolist() == [1, 2]
        np.testing.assert_array_equal(mr.output_logprobs, np.linspace(-0.1, -1.0, 3, dtype=np.float32))
        assert (mr.input_len, mr.output_len, mr.stop_reason) == (2, 3, "stop")

    def test_32k_token_trajectory_is_zero_copy(self) -> None:
        n = 32_768
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 150_000, n, dtype=np.int32)
        logprobs = -rng.random(n, dtype=np.float32)
        msg = trajectory(
            Interaction(
                interaction_id="big",
                model_response=ModelResponse.from_arrays(np.arange(512), tokens, logprobs),
            )
        )
        back = decode_message(*encode(msg))
        mr = back.interactions[0].model_response
        arr = mr.output_tokens
        assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype("<i4")
        assert arr.base is mr.output_tokens_raw and isinstance(arr.base, bytes)  # a view, no copy
        assert arr.flags.writeable is False
        np.testing.assert_array_equal(arr, tokens)
        assert mr.output_logprobs.base is mr.output_logprobs_raw
        np.testing.assert_array_equal(mr.output_logprobs, logprobs)
        assert mr.output_len == n

    def test_discard_group(self) -> None:
        msg = DiscardGroup(group_id="g1", reason="env crashed", requested_at=12.5)
        value, hdrs = encode(msg)
        assert dict(hdrs)[KIND_HEADER] == b"discard"
        assert decode_message(value, hdrs) == msg

    def test_full_group_verdict(self) -> None:
        obs = (
            PRMMetricObservation(
                metric_id="over_budget",
                scope="turn",
                target_id="i1",
                value=True,
                value_type="boolean",
                aggregations=("count", "rate"),
            ),
            PRMMetricObservation(
                metric_id="len",
                scope="trajectory",
                target_id="t1",
                value=3.0,
                value_type="float",
                aggregations=("sum", "mean"),
            ),
        )
        dense = TokenRewards.from_array(np.array([0.1, 0.2, 0.3], dtype=np.float32))
        session = SessionResult(
            session_id="s1",
            trajectory_id="t1",
            status="scored",
            outcome_reward=1.0,
            policy_version=3,
            branches=[
                BranchResult(
                    leaf_id="i2",
                    path=["i1", "i2"],
                    token_rewards={"i1": TokenRewards.from_array(np.full(3, -0.5)), "i2": dense},
                    scorer_totals={"length_budget": -0.4},
                )
            ],
            turn_results=[
                PRMTurnResult(interaction_id="i1", scorer_name="length_budget", reward=-0.5, observations=obs)
            ],
            stats={"prm/length_budget/over_budget/rate": 1.0},
            turns=[
                TokenTurn(
                    interaction_id="i1", prompt_delta_raw=b"\x01\x00\x00\x00", output_tokens_raw=b"\x02\x00\x00\x00"
                ),
                TokenTurn(interaction_id="i2", parent_id="i1", output_tokens_raw=b"\x03\x00\x00\x00"),
            ],
            created_at=1.0,
            scored_at=2.0,
        )
        verdict = GroupVerdict(
            group_id="g1",
            status="accepted",
            verdict_version=2,
            group_size=2,
            sessions=[session, SessionResult(session_id="s2", trajectory_id="t2", status="failed", error="boom")],
            scorers=[ScorerInfo("length_budget", "1")],
            worker_id="w-0",
            decided_at=3.0,
            timings={"score_s": 0.25},
        )
        value, hdrs = encode(verdict)
        assert dict(hdrs)[KIND_HEADER] == b"verdict"
        back = decode_verdict(value, hdrs)
        assert back == verdict
        br = back.sessions[0].branches[0]
        assert br.token_rewards["i1"].uniform == -0.5 and br.token_rewards["i1"].values_raw is None
        np.testing.assert_array_equal(br.token_rewards["i2"].to_numpy(), np.array([0.1, 0.2, 0.3], np.float32))
        assert back.sessions[0].turn_results[0].observations[0].value is True

    def test_verdict_decoder_refuses_trajectory_kind(self) -> None:
        value, hdrs = encode(trajectory())
        with pytest.raises(UnknownMessageKind, match="'ready'.*verdict"):
            decode_verdict(value, hdrs)


# --------------------------------------------------------------------------- decode failures
class TestHeaders:
    def test_unknown_schema_version(self) -> None:
        value, _ = encode(trajectory())
        with pytest.raises(UnknownSchemaVersion, match=r"schema version '99' is not supported"):
            decode_message(value, headers(version="99"))

    def test_non_numeric_schema_version(self) -> None:
        value, _ = encode(trajectory())
        with pytest.raises(UnknownSchemaVersion, match="'v1'"):
            decode_message(value, headers(version="v1"))

    def test_missing_schema_header(self) -> None:
        value, _ = encode(trajectory())
        with pytest.raises(UnknownSchemaVersion, match=f"missing '{SCHEMA_HEADER}' header"):
            decode_message(value, [(KIND_HEADER, b"ready")])
        with pytest.raises(UnknownSchemaVersion, match="missing"):
            decode_message(value, None)

    def test_unknown_kind(self) -> None:
        value, _ = encode(trajectory())
        with pytest.raises(UnknownMessageKind, match=r"'bogus' is not one of \['ready', 'discard', 'chunk'\]"):
            decode_message(value, headers(kind="bogus"))

    def test_missing_kind_header(self) -> None:
        value, _ = encode(trajectory())
        with pytest.raises(UnknownMessageKind, match="kind"):
            decode_message(value, [(SCHEMA_HEADER, b"1")])

    def test_kind_payload_mismatch(self) -> None:
        value, _ = encode(DiscardGroup(group_id="g1"))
        with pytest.raises(InvalidMessage, match="header says 'ready' but the payload is 'discard'"):
            decode_message(value, headers("ready"))

    def test_tombstone(self) -> None:
        with pytest.raises(InvalidMessage, match="no value"):
            decode_message(None, headers())


class TestPayload:
    def test_garbage_bytes(self) -> None:
        with pytest.raises(InvalidMessage, match="malformed"):
            decode_message(b"\xc1\xc1 not msgpack", headers())

    def test_truncated_msgpack(self) -> None:
        value, hdrs = encode(trajectory())
        with pytest.raises(InvalidMessage, match="truncated"):
            decode_message(value[: len(value) // 2], hdrs)

    def test_wrong_type(self) -> None:
        with pytest.raises(InvalidMessage, match=r"^group_size: Expected `int`, got `str`$"):
            decode_raw(raw_trajectory(group_size="2"))

    def test_tokens_as_list_instead_of_bytes(self) -> None:
        raw = raw_trajectory()
        raw["interactions"][0]["model_response"]["output_tokens"] = [1, 2, 3]
        with pytest.raises(InvalidMessage, match=r"^interactions\[0\].model_response.output_tokens: Expected `bytes`"):
            decode_raw(raw)

    def test_nan_outcome_reward(self) -> None:
        with pytest.raises(InvalidMessage, match="outcome_reward must be finite"):
            decode_raw(raw_trajectory(outcome_reward=math.nan))

    def test_logprobs_length_mismatch(self) -> None:
        raw = raw_trajectory()
        raw["interactions"][0]["model_response"]["output_logprobs"] = np.zeros(2, "<f4").tobytes()
        with pytest.raises(InvalidMessage, match="output_logprobs: 2 values for 3 output tokens"):
            decode_raw(raw)

    def test_token_bytes_not_multiple_of_four(self) -> None:
        raw = raw_trajectory()
        raw["interactions"][0]["model_response"]["output_tokens"] = b"\x01\x02\x03"
        with pytest.raises(InvalidMessage, match="multiple of 4"):
            decode_raw(raw)

    def test_duplicate_interaction_ids(self) -> None:
        raw = raw_trajectory()
        raw["interactions"][1]["interaction_id"] = "i1"
        raw["interactions"][1].pop("parent_id")
        with pytest.raises(InvalidMessage, match="duplicate interaction_id 'i1'"):
            decode_raw(raw)

    def test_cyclic_parents(self) -> None:
        raw = raw_trajectory()
        raw["interactions"][0]["parent_id"] = "i2"
        with pytest.raises(InvalidMessage, match=r"cycle through \['i1', 'i2'\]"):
            decode_raw(raw)

    def test_unknown_parent(self) -> None:
        raw = raw_trajectory()
        raw["interactions"][1]["parent_id"] = "ghost"
        with pytest.raises(InvalidMessage, match="'i2' has unknown parent_id 'ghost'"):
            decode_raw(raw)

    def test_empty_interactions(self) -> None:
        with pytest.raises(InvalidMessage, match="interactions must not be empty"):
            decode_raw(raw_trajectory(interactions=[]))

    def test_group_size_zero(self) -> None:
        with pytest.raises(InvalidMessage, match="group_size must be >= 1"):
            decode_raw(raw_trajectory(group_size=0))

    def test_unknown_payload_tag(self) -> None:
        with pytest.raises(InvalidMessage, match="Invalid value 'verdict'"):
            decode_raw(raw_trajectory(kind="verdict"))

    @pytest.mark.parametrize("exc", [UnknownSchemaVersion, UnknownMessageKind, InvalidMessage])
    def test_all_errors_are_schema_errors(self, exc: type[Exception]) -> None:
        assert issubclass(exc, SchemaError) and issubclass(exc, ValueError)


class TestConstruction:
    def test_constructor_runs_the_same_rules(self) -> None:
        with pytest.raises(ValueError, match="outcome_reward must be finite"):
            trajectory(outcome_reward=math.inf)
        with pytest.raises(ValueError, match="output_logprobs: 1 values for 3 output tokens"):
            ModelResponse.from_arrays([1], [1, 2, 3], [0.0])

    def test_token_ids_must_be_integers(self) -> None:
        with pytest.raises(ValueError, match="must be integers"):
            pack_array([1.5, 2.0], np.dtype("<i4"))

    def test_token_ids_are_non_negative_int32(self) -> None:
        with pytest.raises(ValueError, match="non-negative int32"):
            ModelResponse.from_arrays([1], [2**31])
        with pytest.raises(ValueError, match="non-negative int32"):
            ModelResponse.from_arrays([1], np.array([-1], dtype=np.int32))
        edge = ModelResponse.from_arrays([1], np.array([2**31 - 1, 0], dtype=np.int64))
        assert edge.output_tokens.tolist() == [2**31 - 1, 0]

    def test_negative_token_ids_from_the_wire_are_refused(self) -> None:
        """Packed bytes skip pack_array: the struct checks them itself, as every decoder does."""
        with pytest.raises(SchemaError, match="output_tokens: token ids must be non-negative"):
            ModelResponse(
                input_tokens_raw=np.array([1], np.int32).tobytes(),
                output_tokens_raw=np.array([5, -1], np.int32).tobytes(),
            )

    def test_pack_array_accepts_torch(self) -> None:
        mr = ModelResponse.from_arrays(torch.tensor([1, 2]), torch.tensor([3, 4, 5]), torch.zeros(3))
        assert mr.output_tokens.tolist() == [3, 4, 5]

    def test_pack_array_refuses_2d(self) -> None:
        with pytest.raises(ValueError, match="1-D"):
            pack_array(np.zeros((2, 2), np.int32), np.dtype("<i4"))


# --------------------------------------------------------------------------- TokenRewards
class TestTokenRewards:
    def test_uniform_is_compact(self) -> None:
        tr = TokenRewards.from_array(np.full(4096, 0.25, dtype=np.float32))
        assert (tr.length, tr.uniform, tr.values_raw) == (4096, 0.25, None)
        np.testing.assert_array_equal(tr.to_numpy(), np.full(4096, 0.25, np.float32))
        assert len(msgspec.msgpack.encode(tr)) < 32  # no per-token payload

    def test_dense(self) -> None:
        tr = TokenRewards.from_array(torch.tensor([0.0, 1.0, 0.5]))
        assert tr.uniform is None and tr.length == 3
        np.testing.assert_array_equal(tr.to_numpy(), np.array([0.0, 1.0, 0.5], np.float32))
        assert tr.to_numpy().base is tr.values_raw

    def test_empty(self) -> None:
        tr = TokenRewards.from_array(np.zeros(0, np.float32))
        assert tr.length == 0 and tr.to_numpy().shape == (0,)

    def test_needs_exactly_one_representation(self) -> None:
        with pytest.raises(ValueError, match="exactly one of 'uniform' and 'values'"):
            TokenRewards(length=2)
        with pytest.raises(ValueError, match="exactly one"):
            TokenRewards(length=1, uniform=0.0, values_raw=b"\0\0\0\0")

    def test_length_mismatch(self) -> None:
        with pytest.raises(ValueError, match="1 values for length 2"):
            TokenRewards(length=2, values_raw=b"\0\0\0\0")

    def test_negative_length(self) -> None:
        with pytest.raises(ValueError, match="length must be >= 0"):
            TokenRewards(length=-1, uniform=0.0)

    def test_non_finite(self) -> None:
        with pytest.raises(ValueError, match="uniform must be finite"):
            TokenRewards(length=2, uniform=math.nan)
        with pytest.raises(ValueError, match="values must be finite"):
            TokenRewards.from_array(np.array([0.0, np.inf], np.float32))


# --------------------------------------------------------------------------- observations
def observation(**kw: Any) -> PRMMetricObservation:
    fields: dict[str, Any] = dict(
        metric_id="m", scope="turn", target_id="i1", value=1.5, value_type="float", aggregations=("sum",)
    )
    fields.update(kw)
    return PRMMetricObservation(**fields)


class TestObservation:
    def test_valid(self) -> None:
        observation()
        observation(value=2, aggregations=("mean", "sum"))
        observation(value=False, value_type="boolean", aggregations=("count", "rate"), scope="trajectory")

    def test_scope(self) -> None:
        with pytest.raises(ValueError, match="scope must be 'turn' or 'trajectory', got 'branch'"):
            observation(scope="branch")

    def test_value_type(self) -> None:
        with pytest.raises(ValueError, match="value_type must be 'float' or 'boolean', got 'int'"):
            observation(value_type="int")

    def test_float_aggregations(self) -> None:
        with pytest.raises(ValueError, match=r"float observations allow sum/mean, not \['rate'\]"):
            observation(aggregations=("sum", "rate"))

    def test_boolean_aggregations(self) -> None:
        with pytest.raises(ValueError, match=r"boolean observations allow count/rate, not \['mean'\]"):
            observation(value=True, value_type="boolean", aggregations=("mean",))

    def test_empty_aggregations(self) -> None:
        with pytest.raises(ValueError, match="aggregations must not be empty"):
            observation(aggregations=())

    def test_duplicate_aggregations(self) -> None:
        with pytest.raises(ValueError, match="duplicate aggregations"):
            observation(aggregations=("sum", "sum"))

    def test_boolean_needs_bool(self) -> None:
        with pytest.raises(ValueError, match="boolean value must be a bool"):
            observation(value=1.0, value_type="boolean", aggregations=("count",))

    def test_a_shape_seen_valid_still_checks_every_value(self) -> None:
        # valid (scope, type, aggregations) shapes skip their re-check; values and ids never do
        observation(value=True, value_type="boolean", aggregations=("count", "rate"))
        observation(value=2.5)
        with pytest.raises(ValueError, match="boolean value must be a bool"):
            observation(value=1.0, value_type="boolean", aggregations=("count", "rate"))
        with pytest.raises(ValueError, match="must be finite"):
            observation(value=float("nan"))
        with pytest.raises(ValueError, match="metric_id must be a non-empty string"):
            observation(metric_id="")
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(observation(value=3.0)), type=PRMMetricObservation)
        assert decoded.value == 3.0
        wire = msgspec.msgpack.encode(
            {
                "metric_id": "m",
                "scope": "turn",
                "target_id": "i1",
                "value": True,
                "value_type": "float",
                "aggregations": ["sum"],
            }
        )
        with pytest.raises(msgspec.ValidationError, match="float value must be an int or float"):
            msgspec.msgpack.decode(wire, type=PRMMetricObservation)  # decoding runs the same checks

    def test_float_refuses_bool(self) -> None:
        with pytest.raises(ValueError, match="float value must be an int or float"):
            observation(value=True)

    def test_nan(self) -> None:
        with pytest.raises(ValueError, match="value must be finite, got nan"):
            observation(value=math.nan)

    def test_empty_metric_id(self) -> None:
        with pytest.raises(ValueError, match="metric_id must be a non-empty string"):
            observation(metric_id="")

    def test_rules_run_on_decode(self) -> None:
        raw = msgspec.msgpack.encode(msgspec.to_builtins(observation()) | {"value": True})
        with pytest.raises(msgspec.ValidationError, match="float value must be an int or float"):
            msgspec.msgpack.decode(raw, type=PRMMetricObservation)


# --------------------------------------------------------------------------- dead letters
def test_dead_letter_header_round_trip() -> None:
    letter = DeadLetter(
        payload=b"\x00\xffraw",
        error_class="InvalidMessage",
        error_message="truncated",
        source_topic="prm.trajectories",
        source_partition=3,
        source_offset=12345,
        attempt=2,
        worker_id="w-1",
        original_headers={SCHEMA_HEADER: "1", KIND_HEADER: "ready"},
    )
    hdrs = dead_letter_headers(letter)
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in hdrs)
    assert dead_letter_from_record(letter.payload, hdrs) == letter


def test_dead_letter_truncates_long_messages() -> None:
    letter = DeadLetter(
        payload=b"", error_class="E", error_message="x" * 10_000, source_topic="t", source_partition=0, source_offset=0
    )
    assert len(dead_letter_from_record(b"", dead_letter_headers(letter)).error_message) == 4000


# --------------------------------------------------------------------------- torch
class TestToTensor:
    def test_zero_copy_view(self) -> None:
        mr = decode_message(*encode(trajectory())).interactions[0].model_response
        for arr, dtype in ((mr.output_tokens, torch.int32), (mr.output_logprobs, torch.float32)):
            t = to_tensor(arr)
            assert t.dtype == dtype
            assert t.data_ptr() == arr.ctypes.data  # same memory, no copy
            assert t.tolist() == arr.tolist()

    def test_empty(self) -> None:
        t = to_tensor(np.zeros(0, np.float32))
        assert t.shape == (0,) and t.dtype == torch.float32


# --------------------------------------------------------------------------- compact token turns
def test_compact_turns_round_trip_a_branching_concat_tree() -> None:
    from infra.schema import compact_turns, expand_turns
    from prm_pipeline.demo.synthetic import make_session

    traj = make_session(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=1,
        turns=3,
        branch_at=0,
        output_tokens=5,
        prompt_tokens=4,
    )
    turns = compact_turns(traj.interactions)
    root = next(t for t in turns if t.parent_id is None)
    assert len(root.prompt_delta_raw) == 4 * 4  # a root's delta is its whole prompt
    assert all(len(t.prompt_delta_raw) == 4 * 4 for t in turns if t.parent_id)  # 4 follow-up tokens each
    rebuilt = {i.interaction_id: i.model_response for i in expand_turns(turns)}
    for it in traj.interactions:
        mr = it.model_response
        assert rebuilt[it.interaction_id].input_tokens.tolist() == mr.input_tokens.tolist()
        assert rebuilt[it.interaction_id].output_tokens.tolist() == mr.output_tokens.tolist()
        assert rebuilt[it.interaction_id].output_logprobs.tolist() == mr.output_logprobs.tolist()
    compact = sum(len(msgspec.msgpack.encode(t)) for t in turns)
    full = sum(len(msgspec.msgpack.encode(i.model_response)) for i in traj.interactions)
    assert compact < full  # history is not repeated


def test_compact_turns_refuses_a_non_prefix_input() -> None:
    from infra.schema import NotConcatExport, compact_turns

    root = Interaction(interaction_id="a", model_response=ModelResponse.from_arrays([1, 2], [3]))
    child = Interaction(interaction_id="b", parent_id="a", model_response=ModelResponse.from_arrays([1, 9, 3, 4], [5]))
    with pytest.raises(NotConcatExport, match="'b': input does not start with parent 'a'"):
        compact_turns([root, child])


# --------------------------------------------------------------------------- typed member failures
def test_failed_member_carries_typed_reason_fields_and_the_readable_line() -> None:
    failed = SessionResult.failure(
        code="judge_failed",
        detail="3 of 3 votes failed",
        scorer="openclaw_judge",
        session_id="s",
        trajectory_id="t",
        outcome_reward=1.0,
    )
    assert failed.status == "failed" and failed.error == "judge_failed: 3 of 3 votes failed"
    assert (failed.error_code, failed.error_scorer, failed.error_detail) == (
        "judge_failed",
        "openclaw_judge",
        "3 of 3 votes failed",
    )
    verdict = GroupVerdict(group_id="g", status="rejected", reason="judge_failed", sessions=[failed])
    again = decode_verdict(*encode(verdict)).sessions[0]
    assert again == failed and again.failure_code == "judge_failed"
    assert (
        len(SessionResult.failure(code="scorer_error", detail="y" * 5000, session_id="s", trajectory_id="t").error)
        == 2000
    )


def test_a_failure_needs_a_registered_member_code() -> None:
    with pytest.raises(ValueError, match="'made_up' is not registered as a member code"):
        SessionResult.failure(code="made_up", detail="d", session_id="s", trajectory_id="t")
    with pytest.raises(ValueError, match="'missing_sessions' is not registered as a member code"):
        SessionResult.failure(code="missing_sessions", detail="d", session_id="s", trajectory_id="t")


def test_verdict_reason_code_is_optional_on_the_wire() -> None:
    """``reason_code`` is left out when empty, and a verdict written before it decodes with ``""``."""
    accepted = GroupVerdict(group_id="g", status="accepted")
    assert "reason_code" not in msgspec.msgpack.decode(encode(accepted)[0])
    old_writer = msgspec.msgpack.encode({"group_id": "g", "status": "rejected", "reason": "missing_sessions: 1 of 2"})
    old = decode_verdict(old_writer, encode(accepted)[1])
    assert (old.status, old.reason_code) == ("rejected", "")
    rejected = GroupVerdict(
        group_id="g", status="rejected", reason="missing_sessions: 1 of 2", reason_code="missing_sessions"
    )
    assert decode_verdict(*encode(rejected)).reason_code == "missing_sessions"
    with pytest.raises(InvalidMessage, match="reason_code"):  # free text is never a code
        decode_verdict(
            msgspec.msgpack.encode({"group_id": "g", "status": "discarded", "reason_code": "environment crashed"}),
            encode(accepted)[1],
        )


def test_results_without_failure_encode_as_before_the_typed_fields() -> None:
    scored = SessionResult(session_id="s", trajectory_id="t", status="scored", outcome_reward=0.5)
    assert set(msgspec.msgpack.decode(msgspec.msgpack.encode(scored))) == {
        "session_id",
        "trajectory_id",
        "status",
        "outcome_reward",
    }


def test_failure_code_is_the_typed_field_never_the_text() -> None:
    hand_built = SessionResult(session_id="s", trajectory_id="t", status="failed", error="scorer_timeout: x")
    assert hand_built.failure_code == "scorer_error"  # the text is for people; nothing parses it


def _layout_session(blocks: list[tuple[list[str], list[str]]], results: list[tuple[str, str]]) -> SessionResult:
    branches = [
        BranchResult(leaf_id=path[-1], path=path, token_rewards={}, scorer_totals=dict.fromkeys(scorers, 0.0))
        for path, scorers in blocks
    ]
    return SessionResult(
        session_id="s",
        trajectory_id="t",
        status="scored",
        branches=branches,
        turn_results=[PRMTurnResult(interaction_id=i, scorer_name=n, reward=0.0) for i, n in results],
    )


def test_turn_result_blocks_follow_the_verdict_layout() -> None:
    # two branches sharing root a; scorers x then y; per scorer one result per turn in path order
    session = _layout_session(
        [(["a", "b"], ["x", "y"]), (["a", "c"], ["x", "y"])],
        [("a", "x"), ("b", "x"), ("a", "y"), ("b", "y"), ("a", "x"), ("c", "x"), ("a", "y"), ("c", "y")],
    )
    blocks = session.turn_result_blocks()
    assert blocks is not None and [sorted(b) for b in blocks] == [["x", "y"], ["x", "y"]]
    assert [tr.interaction_id for tr in blocks[1]["y"]] == ["a", "c"]
    # scoring off: branches without scorers, no results
    assert _layout_session([(["a"], [])], []).turn_result_blocks() == [{}]


@pytest.mark.parametrize(
    "results",
    [
        [("a", "x"), ("b", "x")],  # one scorer short
        [("b", "x"), ("a", "x"), ("a", "y"), ("b", "y")],  # turns out of path order
        [("a", "x"), ("a", "y"), ("b", "x"), ("b", "y")],  # turn-major instead of scorer-major
        [("a", "x"), ("b", "x"), ("a", "y"), ("b", "y"), ("a", "z")],  # a result left over
    ],
)
def test_turn_result_blocks_refuse_to_guess(results: list[tuple[str, str]]) -> None:
    assert _layout_session([(["a", "b"], ["x", "y"])], results).turn_result_blocks() is None


def test_token_turn_accessors_are_the_only_reader_of_its_bytes() -> None:
    """The shaper lays sequences out through these views; it never decodes wire bytes itself."""
    from pathlib import Path

    from infra.schema import TokenTurn, pack_array

    turn = TokenTurn(
        interaction_id="a",
        prompt_delta_raw=pack_array([1, 2], np.dtype("<i4")),
        output_tokens_raw=pack_array([3], np.dtype("<i4")),
        output_logprobs_raw=pack_array([-0.5], np.dtype("<f4")),
    )
    assert turn.prompt_delta.tolist() == [1, 2] and turn.output_tokens.tolist() == [3] and turn.output_len == 1
    assert turn.output_logprobs.tolist() == [-0.5] and TokenTurn(interaction_id="b").output_logprobs is None
    assert not turn.output_tokens.flags.writeable
    shaper = Path(__file__).resolve().parents[2] / "shaper"
    readers = [
        f"{p.name}:{n}"
        for p in shaper.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "frombuffer" in line or "_raw" in line
    ]
    assert readers == [], "use infra.schema's accessors, not the packed bytes"
