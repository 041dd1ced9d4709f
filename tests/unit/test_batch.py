"""Concat export of hand-built verdicts into padded training tensors (shaper.batch).

The builders at the top are shared with the verdict-consumer integration tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch

from infra.schema import (
    BranchResult,
    GroupVerdict,
    Interaction,
    ModelResponse,
    SessionResult,
    TokenRewards,
    compact_turns,
    decode_verdict,
    encode,
)
from shaper import ConcatExportError, TrainingBatch, build_training_batch, export_group
from shaper.batch import collate, turns_from_interactions
from shaper.filters import (
    decide_mixed_or_penalized_all_wrong_mask_no_eos as filter_mixed_or_penalized_all_wrong_mask_no_eos,
)


# --------------------------------------------------------------------------- builders
def turn(
    iid: str,
    parent: str | None,
    inp: Sequence[int],
    out: Sequence[int],
    logp: Sequence[float] | None = None,
    stop: str = "stop",
) -> Interaction:
    if logp is None:
        logp = [-0.1 * (k + 1) for k in range(len(out))]
    return Interaction(
        interaction_id=iid,
        parent_id=parent,
        model_response=ModelResponse.from_arrays(
            np.asarray(inp, np.int32), np.asarray(out, np.int32), np.asarray(logp, np.float32), stop
        ),
    )


def rewards(values: float | Sequence[float], length: int | None = None) -> TokenRewards:
    if isinstance(values, (int, float)):
        assert length is not None
        return TokenRewards(length=length, uniform=float(values))
    return TokenRewards.from_array(np.asarray(values, np.float32))


def branch(
    path: Sequence[str], token_rewards: Mapping[str, TokenRewards], totals: Mapping[str, float] | None = None
) -> BranchResult:
    return BranchResult(
        leaf_id=path[-1], path=list(path), token_rewards=dict(token_rewards), scorer_totals=dict(totals or {"len": 0.0})
    )


def session(
    sid: str,
    interactions: Sequence[Interaction],
    branches: Sequence[BranchResult] = (),
    *,
    outcome: float = 1.0,
    status: str = "scored",
    stats: Mapping[str, float] | None = None,
    is_eval: bool = False,
) -> SessionResult:
    return SessionResult(
        session_id=sid,
        trajectory_id=f"traj-{sid}",
        status=status,  # type: ignore[arg-type]
        outcome_reward=outcome,
        is_eval=is_eval,
        branches=list(branches),
        stats=dict(stats or {}),
        turns=compact_turns(interactions) if status == "scored" else [],
        error="scorer_error: boom" if status == "failed" else None,
    )


def verdict(
    gid: str,
    sessions: Sequence[SessionResult],
    status: str = "accepted",
    reason: str = "",
    version: int = 1,
    code: str = "",
) -> GroupVerdict:
    return GroupVerdict(
        group_id=gid,
        status=status,
        reason=reason,
        verdict_version=version,  # type: ignore[arg-type]
        group_size=len(sessions),
        sessions=list(sessions),
        worker_id="test",
        reason_code=code,
    )


def simple_session(
    sid: str,
    *,
    outcome: float = 1.0,
    reward: float = 0.5,
    prompt: int = 3,
    out: int = 2,
    stats: Mapping[str, float] | None = None,
    base: int = 1,
) -> SessionResult:
    """A one-turn session with uniform process reward ``reward``."""
    t = turn(f"{sid}-t0", None, range(base, base + prompt), range(100 + base, 100 + base + out))
    return session(
        sid, [t], [branch([t.interaction_id], {t.interaction_id: rewards(reward, out)})], outcome=outcome, stats=stats
    )


def accepted_group(gid: str, outcomes: Sequence[float] = (1.0, 0.0), **kwargs) -> GroupVerdict:
    return verdict(gid, [simple_session(f"{gid}-s{k}", outcome=o, **kwargs) for k, o in enumerate(outcomes)])


# Two turns: t0 sees [1, 2, 3] and says [4, 5]; a tool adds [6, 7]; t1 says [8, 9, 10].
T0 = turn("t0", None, [1, 2, 3], [4, 5], [-0.1, -0.2])
T1 = turn("t1", "t0", [1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [-0.3, -0.4, -0.5])


def two_turn_verdict(t0_rewards: TokenRewards | None = None, t1_rewards: TokenRewards | None = None) -> GroupVerdict:
    tr = {"t0": t0_rewards or rewards([0.5, -0.5]), "t1": t1_rewards or rewards(1.0, 3)}
    return verdict("g", [session("s", [T0, T1], [branch(["t0", "t1"], tr)], outcome=0.75)])


# --------------------------------------------------------------------------- layout
class TestTwoTurnBranch:
    def test_tokens_are_the_leaf_input_plus_output(self) -> None:
        batch = build_training_batch([two_turn_verdict()])
        assert batch.input_ids.dtype == torch.int64
        assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
        assert batch.attention_mask.tolist() == [[True] * 10]

    def test_loss_mask_is_exactly_every_turns_output(self) -> None:
        batch = build_training_batch([two_turn_verdict()])
        expected = [False, False, False, True, True, False, False, True, True, True]
        assert batch.loss_mask.tolist() == [expected]
        assert batch.turn_index.tolist() == [[-1, -1, -1, 0, 0, -1, -1, 1, 1, 1]]

    def test_rewards_land_on_output_positions_and_prompt_is_zero(self) -> None:
        batch = build_training_batch([two_turn_verdict()])
        assert batch.token_rewards.dtype == torch.float32
        assert batch.token_rewards.tolist() == [[0, 0, 0, 0.5, -0.5, 0, 0, 1.0, 1.0, 1.0]]
        # Unshifted: the reward sits on the generated token itself, never on the prompt.
        assert float(batch.token_rewards[~batch.loss_mask].abs().sum()) == 0.0

    def test_logprobs_follow_the_outputs(self) -> None:
        batch = build_training_batch([two_turn_verdict()])
        torch.testing.assert_close(
            batch.logprobs, torch.tensor([[0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5]]), rtol=0, atol=1e-7
        )

    def test_per_row_fields(self) -> None:
        batch = build_training_batch([two_turn_verdict()], metrics={"m": 1.0})
        assert batch.rewards.tolist() == [0.75]
        assert batch.is_truncated.tolist() == [False]
        assert batch.group_ids == ["g"] and batch.session_ids == ["s"]
        assert batch.trajectory_ids == ["traj-s"] and batch.leaf_ids == ["t1"]
        assert batch.metrics == {"m": 1.0}
        assert (batch.batch_size, batch.seq_len, batch.num_groups, batch.num_tokens) == (1, 10, 1, 5)

    def test_survives_the_wire(self) -> None:
        value, headers = encode(two_turn_verdict())
        batch = build_training_batch([decode_verdict(value, headers)])
        assert batch.token_rewards.tolist() == [[0, 0, 0, 0.5, -0.5, 0, 0, 1.0, 1.0, 1.0]]


def test_two_branches_sharing_a_root_make_two_rows_with_branch_local_rewards() -> None:
    root = turn("r", None, [1, 2], [3, 4])
    a = turn("a", "r", [1, 2, 3, 4, 9], [5])
    b = turn("b", "r", [1, 2, 3, 4, 8], [6, 7], stop="length")
    s = session(
        "s",
        [root, a, b],
        [
            branch(["r", "a"], {"r": rewards(0.1, 2), "a": rewards(1.0, 1)}),
            branch(["r", "b"], {"r": rewards(-0.2, 2), "b": rewards([0.3, 0.4])}),
        ],
    )
    batch = build_training_batch([verdict("g", [s])])
    assert batch.leaf_ids == ["a", "b"]
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 9, 5, 0], [1, 2, 3, 4, 8, 6, 7]]
    torch.testing.assert_close(
        batch.token_rewards,
        torch.tensor([[0, 0, 0.1, 0.1, 0, 1.0, 0], [0, 0, -0.2, -0.2, 0, 0.3, 0.4]]),
        rtol=0,
        atol=1e-7,
    )
    assert batch.loss_mask.tolist() == [
        [False, False, True, True, False, True, False],
        [False, False, True, True, False, True, True],
    ]
    assert batch.turn_index.tolist() == [[-1, -1, 0, 0, -1, 1, -1], [-1, -1, 0, 0, -1, 1, 1]]
    assert batch.is_truncated.tolist() == [False, True]  # the leaf's stop_reason decides
    assert batch.session_ids == ["s", "s"] and batch.group_ids == ["g", "g"]


class TestRefusals:
    def test_non_prefix_input_names_session_and_turn(self) -> None:
        bad = turn("t1", "t0", [1, 2, 3, 4, 99, 6, 7], [8])
        with pytest.raises(ConcatExportError, match=r"group 'g' session 's' turn 't1'.*token 4 is 99") as info:
            turns_from_interactions([T0, bad], group_id="g", session_id="s")
        assert info.value.reason == "not_prefix"
        assert (info.value.session_id, info.value.interaction_id) == ("s", "t1")

    def test_parent_input_must_be_kept_too(self) -> None:
        bad = turn("t1", "t0", [1, 7, 3, 4, 5, 6], [8])
        with pytest.raises(ConcatExportError, match="token 1 is 7, the parent's input token 1 is 2"):
            turns_from_interactions([T0, bad], group_id="g", session_id="s")

    def test_input_shorter_than_parent_context(self) -> None:
        short = turn("t1", "t0", [1, 2, 3, 4], [8])
        with pytest.raises(ConcatExportError, match="fewer than its parent"):
            turns_from_interactions([T0, short], group_id="g", session_id="s")

    def test_valid_interactions_round_trip_to_the_same_rows(self) -> None:
        turns = turns_from_interactions([T0, T1])
        assert [t.interaction_id for t in turns] == ["t0", "t1"]
        assert turns == compact_turns([T0, T1])

    def test_reward_length_must_match_the_turn(self) -> None:
        with pytest.raises(ConcatExportError, match="length 4 but the turn generated 3") as info:
            build_training_batch([two_turn_verdict(t1_rewards=rewards(1.0, 4))])
        assert info.value.reason == "reward_length"

    def test_branch_path_must_be_a_tree_path(self) -> None:
        v = verdict("g", [session("s", [T0, T1], [branch(["t1"], {})])])
        with pytest.raises(ConcatExportError) as info:
            build_training_batch([v])
        assert info.value.reason == "branch_mismatch"

    def test_every_leaf_needs_its_branch(self) -> None:
        extra = turn("t1b", "t0", [1, 2, 3, 4, 5], [6])
        v = verdict("g", [session("s", [T0, T1, extra], [branch(["t0", "t1"], {})])])
        with pytest.raises(ConcatExportError, match="t1b") as info:
            build_training_batch([v])
        assert info.value.reason == "branch_mismatch"

    def test_not_token_backed(self) -> None:
        with pytest.raises(ConcatExportError) as info:
            turns_from_interactions([Interaction(interaction_id="x")], session_id="s")
        assert info.value.reason == "not_token_backed"

    def test_scored_member_without_turns(self) -> None:
        s = SessionResult(session_id="s", trajectory_id="t", status="scored", outcome_reward=1.0)
        with pytest.raises(ConcatExportError) as info:
            build_training_batch([verdict("g", [s])])
        assert info.value.reason == "no_interactions"

    def test_unscored_member_in_accepted_verdict(self) -> None:
        with pytest.raises(ConcatExportError) as info:
            build_training_batch([verdict("g", [session("s", [T0], status="failed")])])
        assert info.value.reason == "session_not_scored"

    def test_only_accepted_verdicts(self) -> None:
        with pytest.raises(ValueError, match="only accepted"):
            export_group(verdict("g", [], status="rejected", reason="missing_sessions"))


# --------------------------------------------------------------------------- padding, rewards
def test_padding_right_with_pad_id_and_masks_off() -> None:
    long = accepted_group("g1", (1.0,), prompt=4, out=3)  # length 7
    short = accepted_group("g2", (0.0,), prompt=2, out=1)  # length 3
    batch = build_training_batch([long, short], pad_token_id=-1)
    assert batch.seq_len == 7
    assert batch.input_ids[1].tolist() == [1, 2, 101, -1, -1, -1, -1]
    assert batch.attention_mask[1].tolist() == [True] * 3 + [False] * 4
    assert batch.loss_mask[1].tolist() == [False, False, True] + [False] * 4
    assert batch.token_rewards[1, 3:].abs().sum().item() == 0.0
    assert batch.logprobs[1, 3:].abs().sum().item() == 0.0
    assert batch.group_ids == ["g1", "g2"]
    assert batch.rewards.tolist() == [1.0, 0.0]


def test_pad_to_multiple_of() -> None:
    batch = build_training_batch([accepted_group("g", (1.0,), prompt=4, out=3)], pad_to_multiple_of=8)
    assert batch.seq_len == 8 and batch.attention_mask.sum().item() == 7


def test_uniform_and_dense_token_rewards_lay_out_alike() -> None:
    uniform = TokenRewards.from_array(np.full(3, 0.25, np.float32))
    dense = TokenRewards.from_array(np.array([0.25, 0.5, 0.25], np.float32))
    assert uniform.uniform == 0.25 and uniform.values_raw is None  # compact on the wire
    assert dense.uniform is None and dense.values_raw is not None
    a = build_training_batch([two_turn_verdict(t1_rewards=uniform)])
    b = build_training_batch([two_turn_verdict(t1_rewards=dense)])
    assert a.token_rewards[0, 7:].tolist() == [0.25, 0.25, 0.25]
    assert b.token_rewards[0, 7:].tolist() == [0.25, 0.5, 0.25]
    assert a.token_rewards[0, :7].tolist() == b.token_rewards[0, :7].tolist()


def test_scoring_disabled_exports_every_branch_with_zero_rewards() -> None:
    extra = turn("t1b", "t0", [1, 2, 3, 4, 5], [6])
    batch = build_training_batch([verdict("g", [session("s", [T0, T1, extra])])])
    assert batch.leaf_ids == ["t1", "t1b"]
    assert batch.token_rewards.abs().sum().item() == 0.0
    assert batch.loss_mask.sum(dim=-1).tolist() == [5, 3]


def test_empty_batch() -> None:
    batch = build_training_batch([])
    assert tuple(batch.input_ids.shape) == (0, 0) and batch.rewards.shape == (0,)


def test_to_moves_every_tensor() -> None:
    batch = build_training_batch([two_turn_verdict()], metrics={"m": 1.0})
    moved = batch.to("meta")
    for name in TrainingBatch._TENSORS:
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(batch, name).device.type == "cpu", name
    assert moved.group_ids == batch.group_ids and moved.metrics == {"m": 1.0}


def test_filter_inputs_feed_the_group_filters() -> None:
    all_wrong = verdict(
        "g", [simple_session("a", outcome=0.0, reward=-1.0), simple_session("b", outcome=0.0, reward=0.0)]
    )
    inputs = export_group(all_wrong).filter_inputs()
    assert set(inputs) >= {"original_rewards", "token_rewards", "loss_mask", "is_truncated"}
    decision = filter_mixed_or_penalized_all_wrong_mask_no_eos(inputs)
    assert (decision.keep, decision.reason) == (True, "penalized_all_wrong")


def truncated_session(sid: str, reward: float) -> SessionResult:
    t = turn(f"{sid}-t0", None, [1, 2], [3, 4, 5], stop="length")
    return session(sid, [t], [branch([t.interaction_id], {t.interaction_id: rewards(reward, 3)})], outcome=0.0)


@pytest.mark.parametrize(
    "sessions",
    [
        [simple_session("a", outcome=0.0, reward=-1.0), simple_session("b", outcome=0.0, reward=0.0, out=4)],
        [simple_session("a", outcome=0.0, reward=0.0), simple_session("b", outcome=0.0, reward=0.0)],
        [simple_session("a", outcome=1.0), simple_session("b", outcome=0.0)],
        [simple_session("a", outcome=1.0), simple_session("b", outcome=1.0, reward=-1.0)],
        [truncated_session("a", -1.0), simple_session("b", outcome=0.0, reward=0.0)],  # penalty in a truncated row
        [truncated_session("a", -1.0), simple_session("b", outcome=0.0, reward=-0.5)],
    ],
)
def test_filters_read_the_group_as_they_read_its_padded_tensors(sessions) -> None:
    from shaper.filters import FILTERS

    group = export_group(verdict("g", sessions))
    padded = group.filter_inputs()
    assert set(padded) == set(group.FILTER_KEYS) and "rewards" not in group
    for name, rule in FILTERS.items():
        assert rule(group) == rule(padded), name


def test_filtering_a_group_builds_no_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from shaper import batch as batch_module

    def no_padding(*_args, **_kwargs):
        raise AssertionError("the filter padded the group")

    monkeypatch.setattr(batch_module, "_pad", no_padding)
    group = export_group(
        verdict("g", [simple_session("a", outcome=0.0, reward=-1.0), simple_session("b", outcome=0.0, reward=0.0)])
    )
    assert filter_mixed_or_penalized_all_wrong_mask_no_eos(group).reason == "penalized_all_wrong"


def test_collate_matches_build() -> None:
    v = [accepted_group("g1"), accepted_group("g2", (0.0, 0.0))]
    a = build_training_batch(v)
    b = collate(export_group(x) for x in v)  # a one-shot iterator is fine
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.group_ids == b.group_ids
