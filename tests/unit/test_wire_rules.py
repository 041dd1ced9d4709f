"""The rules docs/wire.md states for producers, checked against the code that applies them:
which errors dead-letter a record (and with which class), and which only fail the member."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from infra.schema import (
    KIND_HEADER,
    SCHEMA_HEADER,
    Interaction,
    InvalidMessage,
    ModelResponse,
    ReadyTrajectory,
    UnknownMessageKind,
    UnknownSchemaVersion,
    decode_message,
    encode,
    pack_array,
)
from scoring_workers.prm import PRMConfig, PRMRunner
from scoring_workers.scorers import LengthBudgetScorer
from scoring_workers.scoring import score_member


def _traj(output: list[int], *, token_rewards: list[float] | None = None) -> ReadyTrajectory:
    raw = None if token_rewards is None else pack_array(np.asarray(token_rewards, np.float32), np.dtype("<f4"))
    return ReadyTrajectory(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=1,
        outcome_reward=1.0,
        interactions=[
            Interaction(
                interaction_id="a", model_response=ModelResponse.from_arrays([1, 2], output), token_rewards_raw=raw
            )
        ],
    )


VALUE, HEADERS = encode(_traj([3, 4]))


def _payload(**changes: object) -> bytes:
    obj = msgspec.msgpack.decode(VALUE)
    obj.update(changes)
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    ("value", "headers", "error"),
    [
        (VALUE, [(KIND_HEADER, b"ready")], UnknownSchemaVersion),
        (VALUE, [(SCHEMA_HEADER, b"99"), (KIND_HEADER, b"ready")], UnknownSchemaVersion),
        (VALUE, [(SCHEMA_HEADER, b"1")], UnknownMessageKind),
        (VALUE, [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"verdict")], UnknownMessageKind),  # not a kind of this topic
        (VALUE, [(SCHEMA_HEADER, b"1"), (KIND_HEADER, b"discard")], InvalidMessage),  # header and payload differ
        (None, HEADERS, InvalidMessage),  # tombstone
        (b"", HEADERS, InvalidMessage),
        (VALUE[:-3], HEADERS, InvalidMessage),  # truncated
        (b"\xc1not msgpack", HEADERS, InvalidMessage),
        (VALUE + b"\x00", HEADERS, InvalidMessage),  # trailing bytes
        (msgspec.msgpack.encode(7), HEADERS, InvalidMessage),  # not a map
        (msgspec.msgpack.encode([1, 2]), HEADERS, InvalidMessage),
        (_payload(kind="weird"), HEADERS, InvalidMessage),
        (_payload(outcome_reward=math.inf), HEADERS, InvalidMessage),  # non-finite where finite is required
    ],
)
def test_headers_table_classes(value: bytes | None, headers, error: type[Exception]) -> None:
    """docs/wire.md "Headers": the dead letter's class for each kind of bad record."""
    with pytest.raises(error):
        decode_message(value, headers)


def test_logprobs_count_mismatch_is_a_dead_letter() -> None:
    obj = msgspec.msgpack.decode(VALUE)
    obj["interactions"][0]["model_response"]["output_logprobs"] = b"\x00" * 4  # 1 value for 2 tokens
    with pytest.raises(InvalidMessage, match="output_logprobs"):
        decode_message(msgspec.msgpack.encode(obj), HEADERS)


@pytest.fixture
async def runner():
    r = await PRMRunner.create(PRMConfig(scorers=[LengthBudgetScorer()]))  # type: ignore[list-item]
    yield r
    await r.aclose()


@pytest.mark.parametrize("token_rewards", [[0.5], [0.5, 0.5, 0.5], [0.5, math.nan]])
async def test_bad_token_rewards_decode_and_reject_the_member_not_dead_letter(runner, token_rewards) -> None:
    """docs/wire.md "Compatibility rules": decodable but not scorable -> invalid_reward."""
    traj = decode_message(*encode(_traj([3, 4], token_rewards=token_rewards)))  # no SchemaError
    result = await score_member(runner, traj, timeout_s=None)
    assert (result.status, result.error_code) == ("failed", "invalid_reward"), result.error


async def test_an_empty_output_fails_with_a_scorer_and_is_a_zero_length_turn_without(runner) -> None:
    """docs/wire.md "ModelResponse": empty output_tokens decode; scoring them is invalid_reward (AReaL)."""
    traj = decode_message(*encode(_traj([])))
    scored = await score_member(runner, traj, timeout_s=None)
    assert (scored.status, scored.error_code) == ("failed", "invalid_reward")
    assert "output_len" in scored.error_detail
    unscored = await score_member(None, traj, timeout_s=None)
    assert unscored.status == "scored" and unscored.turns[0].output_len == 0
