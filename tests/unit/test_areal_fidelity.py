"""Upstream fidelity with AReaL's PRM runner, with concrete values (see docs/compatibility.md)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from infra.config import ActorConfig as Actor
from infra.config import PRMAdvantageShapingConfig as Shaping
from infra.config import PRMConfig
from infra.config import TrainerConfig as Trainer
from infra.schema import Interaction, ModelResponse, SessionResult, decode_message, encode
from scoring_workers.prm import BaseScorer, PRMRunner, PRMScorerResult, failure_code, failure_detail
from scoring_workers.prm.errors import error_context
from tests.unit.test_prm_runner import obs, runner_of, scorer, traj, turn


def with_rewards(iid: str, rewards: list[float], parent: str | None = None) -> Interaction:
    return Interaction(
        interaction_id=iid,
        parent_id=parent,
        model_response=ModelResponse.from_arrays(np.arange(2), np.arange(len(rewards))),
        token_rewards_raw=np.asarray(rewards, dtype=np.float32).tobytes(),
    )


# ----------------------------------------------------------------------------- same-named scorers
async def test_same_named_scorers_both_run_add_up_and_share_metrics() -> None:
    Half = scorer("dup", lambda i, c: 0.5)
    runner = runner_of(Half(weight=1.0), Half(weight=2.0))
    result = await runner.run(traj(turn("a", n=2), turn("b", "a", n=2)))
    (branch,) = result.branches
    assert branch.token_rewards["a"].tolist() == [1.5, 1.5]  # 0.5*1 + 0.5*2
    assert branch.scorer_totals == {"dup": 3.0}  # (0.5 + 0.5) + (1.0 + 1.0): one total per name
    stats = result.stats()
    assert stats["rollout/prm_turn_reward/dup"] == 0.75 and stats["rollout/prm_turn_reward/dup__count"] == 4.0
    assert (
        stats["rollout/prm_trajectory_reward/dup"] == 3.0 and stats["rollout/prm_trajectory_reward/dup__count"] == 1.0
    )
    assert [s.name for s in runner.scorer_infos()] == ["dup", "dup"]


async def test_same_named_scorers_identical_observations_do_not_collide() -> None:
    Obs = scorer("seen", lambda i, c: PRMScorerResult(1.0, (obs("m", i.interaction_id, True),)))
    result = await runner_of(Obs(), Obs()).run(traj(turn("a")))
    stats = result.stats()
    assert stats["rollout/prm_metric/turn/seen/m/observed_count"] == 2.0
    assert stats["rollout/prm_metric/turn/seen/m/count"] == 2.0


async def test_same_named_scorer_with_another_schema_fails_in_the_same_run() -> None:
    A = scorer("shared", lambda i, c: PRMScorerResult(1.0, (obs("m", i.interaction_id, True),)))
    B = scorer("shared", lambda i, c: PRMScorerResult(1.0, (obs("m", i.interaction_id, 2.0, kind="float"),)))
    with pytest.raises(ValueError, match="schema changed across runs"):
        await runner_of(A(), B()).run(traj(turn("a")))


async def test_same_named_channels_add_up() -> None:
    Tok = scorer("tok", lambda i, c: torch.tensor([1.0, 2.0]))
    result = await runner_of(Tok(), Tok(weight=0.5)).run(traj(turn("a", n=2)), keep_channels=True)
    (branch,) = result.branches
    assert branch.channels["tok"]["a"].tolist() == [1.5, 3.0]


# ----------------------------------------------------------------------------- errors
async def test_scorer_exception_propagates_with_notes_and_reason_code() -> None:
    class Mine(KeyError):
        pass

    def fail(i: Any, c: Any) -> float:
        raise Mine("missing field")

    with pytest.raises(Mine) as info:
        await runner_of(scorer("k", fail)()).run(traj(turn("a")))
    exc = info.value
    assert failure_code(exc) == "scorer_error"
    assert failure_detail(exc) == "scorer 'k' raised Mine, interaction 'a': 'missing field'"
    assert error_context(exc).trajectory_id == "traj-1"
    assert "scorer 'k'" in exc.__notes__[0] and "interaction 'a'" in exc.__notes__[0]


@pytest.mark.parametrize(
    ("reward", "kind", "fragment"),
    [
        (torch.zeros(3), ValueError, "must return shape (2,)"),
        (math.nan, ValueError, "non-finite"),
        ("abc", TypeError, "must be a number"),
    ],
)
async def test_validation_errors_use_areal_types(reward: Any, kind: type, fragment: str) -> None:
    with pytest.raises(kind, match=fragment.replace("(", r"\(").replace(")", r"\)")) as info:
        await runner_of(scorer("v", lambda i, c: reward)()).run(traj(turn("a", n=2)))
    assert failure_code(info.value) == "invalid_reward"


async def test_not_token_backed_is_value_error() -> None:
    with pytest.raises(ValueError, match="token-backed interactions") as info:
        await runner_of(scorer("v", lambda i, c: 1.0)()).run(traj(turn("a", backed=False)))
    assert failure_code(info.value) == "not_token_backed"


async def test_worker_timeout_still_maps_to_scorer_timeout() -> None:
    assert failure_code(TimeoutError()) == "scorer_timeout"
    assert failure_code(ValueError("x")) == "scorer_error"


async def test_none_from_evaluate_rejects_before_prepare_result() -> None:
    calls: list[Any] = []

    class Strict(BaseScorer):
        name = "strict"

        async def evaluate(self, interaction: Any, ctx: Any) -> float | None:
            return None

        def prepare_result(self, interaction: Any, result: Any, ctx: Any) -> PRMScorerResult:
            calls.append(result)
            return PRMScorerResult(float(result))  # would raise TypeError on None

    with pytest.raises(RuntimeError, match="returned None") as info:
        await runner_of(Strict()).run(traj(turn("a"), turn("b", "a")))
    assert calls == [] and failure_code(info.value) == "scorer_returned_none" and "2/2" in str(info.value)


# ----------------------------------------------------------------------------- pre-existing token rewards
async def test_existing_token_rewards_are_added_to() -> None:
    result = await runner_of(scorer("s", lambda i, c: 0.5)(weight=2.0)).run(traj(with_rewards("a", [0.25, -1.0])))
    (branch,) = result.branches
    assert branch.token_rewards["a"].tolist() == [1.25, 0.0]
    assert result.turn_results[0].reward == 1.0  # turn-reward metrics exclude the pre-existing part
    assert branch.scorer_totals == {"s": 1.0}


async def test_existing_token_rewards_kept_without_active_scorers() -> None:
    result = await runner_of(scorer("s", lambda i, c: 0.5)(enabled=False)).run(traj(with_rewards("a", [0.25, 3.0])))
    assert result.branches[0].token_rewards["a"].tolist() == [0.25, 3.0]


@pytest.mark.parametrize(
    ("rewards", "fragment"),
    [
        ([0.0, 0.0, 0.0], "Existing token_rewards shape mismatch"),
        ([0.0, math.inf], "non-finite"),
    ],
)
async def test_existing_token_rewards_are_checked(rewards: list[float], fragment: str) -> None:
    bad = Interaction(
        interaction_id="a",
        model_response=ModelResponse.from_arrays(np.arange(2), np.arange(2)),
        token_rewards_raw=np.asarray(rewards, dtype=np.float32).tobytes(),
    )
    with pytest.raises(ValueError, match=fragment) as info:
        await runner_of(scorer("s", lambda i, c: 0.5)()).run(traj(bad))
    assert failure_code(info.value) == "invalid_reward"


def test_token_rewards_field_is_optional_on_the_wire() -> None:
    plain = traj(turn("a", n=2))
    value, headers = encode(plain)
    assert b"token_rewards" not in value  # omitted: existing encodings unchanged
    rich = traj(with_rewards("a", [0.5, -0.5]))
    decoded = decode_message(*encode(rich))
    assert decoded.interactions[0].token_rewards.tolist() == [0.5, -0.5]
    with pytest.raises(ValueError, match="multiple of 4"):
        Interaction(interaction_id="x", token_rewards_raw=b"abc")


# ----------------------------------------------------------------------------- error_policy
def test_error_policy_values() -> None:
    assert PRMConfig().error_policy == "reject"
    with pytest.raises(ValueError, match="error_policy"):
        PRMConfig(error_policy="ignore")


async def test_keep_original_returns_the_unscored_trajectory_and_says_why() -> None:
    def fail(i: Any, c: Any) -> float:
        if i.interaction_id == "b":
            raise RuntimeError("judge down")
        return 1.0

    config = PRMConfig(scorers=[scorer("j", fail)()], error_policy="keep_original")
    trajectory = traj(with_rewards("a", [0.25, 0.25]), with_rewards("b", [-1.0, 0.0], parent="a"))
    result = await PRMRunner(config).run(trajectory)
    assert result.fallback == "keep_original: scorer_error: scorer 'j' raised RuntimeError, interaction 'b': judge down"
    (branch,) = result.branches
    assert branch.token_rewards["a"].tolist() == [0.25, 0.25]  # original, not partially scored
    assert branch.token_rewards["b"].tolist() == [-1.0, 0.0]
    assert branch.turn_results == [] and branch.scorer_totals == {}
    assert result.stats() == {"rollout/prm_fallback": 1.0}
    session = SessionResult(
        session_id="s", trajectory_id="t", status="scored", branches=result.to_branch_results(), error=result.fallback
    )
    assert session.error.startswith("keep_original: scorer_error")


async def test_reject_policy_raises() -> None:
    config = PRMConfig(scorers=[scorer("j", lambda i, c: None)()])
    with pytest.raises(RuntimeError, match="returned None"):
        await PRMRunner(config).run(traj(turn("a")))


# ----------------------------------------------------------------------------- branch grouping
async def test_parentless_turns_are_separate_branches_as_in_areal_export() -> None:
    """AReaL's concat export scores each exported leaf's chain in its own run: two
    parentless turns are two one-turn branches, so identical trajectory-scope
    observations in them do not collide; within one branch they do."""

    def observe(i: Any, c: Any) -> PRMScorerResult:
        return PRMScorerResult(1.0, (obs("len", "session", 1.0, scope="trajectory", kind="float"),))

    result = await runner_of(scorer("t", observe)()).run(traj(turn("a"), turn("b")))
    assert [b.path for b in result.branches] == [["a"], ["b"]]
    assert result.stats()["rollout/prm_metric/trajectory/t/len/observed_count"] == 2.0
    with pytest.raises(ValueError, match="duplicate structured metric"):
        await runner_of(scorer("t", observe)()).run(traj(turn("a"), turn("b", "a")))


# ----------------------------------------------------------------------------- group filters
def _sample(rewards: list[float], tokens: list[list[float]] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"rewards": torch.tensor(rewards)}
    if tokens is not None:
        out["token_rewards"] = torch.tensor(tokens)
        out["loss_mask"] = torch.ones(len(tokens), len(tokens[0]))
    out.update(extra)
    return out


def test_areal_named_filters_return_bool_and_record_areal_scalars() -> None:
    from shaper.filters import ScalarTracker, filter_function, filter_mixed_or_penalized_all_wrong

    tracker = ScalarTracker("rollout")
    results = [
        filter_mixed_or_penalized_all_wrong(_sample([1.0, 0.0]), tracker),  # mixed
        filter_mixed_or_penalized_all_wrong(_sample([1.0, 1.0]), tracker),  # all correct
        filter_mixed_or_penalized_all_wrong(_sample([0.0, 0.0], [[-1.0], [0.0]]), tracker),  # penalized
        filter_mixed_or_penalized_all_wrong(_sample([0.0, 0.0]), tracker),  # all wrong
    ]
    assert results == [True, False, True, False] and all(type(r) is bool for r in results)
    out = tracker.export()
    assert out["rollout/rejected_by_failed_or_perfect"] == 0.5
    assert out["rollout/rejected_by_all_correct"] == 0.25
    assert out["rollout/rejected_by_all_wrong"] == 0.25
    assert out["rollout/accepted_penalized_all_wrong"] == 0.25
    assert out["rollout/rejected_by_all_wrong__count"] == 4.0
    plain = ScalarTracker()
    assert filter_function(_sample([0.9995, 0.9995]), plain) is False
    assert plain.export()["rollout/rejected_by_all_correct"] == 1.0  # "all correct" = all >= 0.999


def test_filter_edge_inputs_as_areal() -> None:
    from shaper.filters import filter_mixed_or_penalized_all_wrong as f
    from shaper.filters import filter_mixed_or_penalized_all_wrong_mask_no_eos as g

    t = ScalarTrackerFactory()
    # token rewards without a loss mask: no penalty
    assert f({"rewards": torch.zeros(2), "token_rewards": torch.full((2, 2), -1.0)}, t) is False
    # non-finite token rewards: ValueError, but only looked at for uniform all-wrong groups
    nan = [[math.nan, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="non-finite"):
        f(_sample([0.0, 0.0], nan), t)
    assert f(_sample([1.0, 0.0], nan), t) is True
    # the no-eos variant needs attention_mask even with is_truncated; non-tensor is_truncated: TypeError
    with pytest.raises(ValueError, match="requires attention_mask"):
        g(_sample([0.0, 0.0], [[-1.0, 0.0], [0.0, 0.0]], is_truncated=torch.tensor([True, False])), t)
    with pytest.raises(TypeError):
        g(
            _sample([0.0, 0.0], [[-1.0, 0.0], [0.0, 0.0]], is_truncated=[True, False], attention_mask=torch.ones(2, 2)),
            t,
        )
    kept = g(
        _sample(
            [0.0, 0.0],
            [[-1.0, 0.0], [0.0, 0.0]],
            is_truncated=torch.tensor([True, False]),
            attention_mask=torch.ones(2, 2),
        ),
        t,
    )
    assert kept is False  # the only penalty sits in a truncated row


def ScalarTrackerFactory() -> Any:  # noqa: N802 - a throwaway tracker so the module one stays clean
    from shaper.filters import ScalarTracker

    return ScalarTracker()


async def test_error_messages_start_with_areal_wording() -> None:
    """AReaL's tests match these messages; ours start with AReaL's words, then add where."""
    import re

    with pytest.raises(ValueError) as shape:  # AReaL: match=r"must return shape \(3,\)"
        await runner_of(scorer("shape", lambda i, c: torch.zeros(2))()).run(traj(turn("a", n=3)))
    assert re.match(r"scorer 'shape' must return shape \(3,\), got a reward tensor of shape \[2\]", str(shape.value))
    assert "(interaction 'a')" in str(shape.value) and failure_code(shape.value) == "invalid_reward"
    with pytest.raises(TypeError, match="must contain PRMMetricObservation"):  # AReaL's test, as written
        await runner_of(scorer("obs", lambda i, c: PRMScorerResult(reward=1.0, observations=(object(),)))()).run(
            traj(turn("a", n=3))
        )
    bad = PRMScorerResult(reward=1.0)  # a result whose observations changed after construction
    object.__setattr__(bad, "observations", (object(),))
    with pytest.raises(TypeError) as observation:
        await runner_of(scorer("obs", lambda i, c: bad)()).run(traj(turn("a", n=3)))
    assert str(observation.value).startswith("scorer 'obs' observations must contain PRMMetricObservation, got object")
    assert "(interaction 'a')" in str(observation.value)


# ----------------------------------------------------------------------------- merge_stats
def test_merge_worker_stats_as_areal() -> None:
    from shaper.metrics import merge_worker_stats

    merged = merge_worker_stats(
        [
            {
                "rollout/prm_turn_reward/s": 1.0,
                "rollout/prm_turn_reward/s__count": 1.0,
                "rollout/prm_metric/turn/s/m/count": 2.0,
                "rollout/other": 5.0,
                "rollout/prm_metric/turn/s/m/rate": 0.5,
            },
            {
                "rollout/prm_turn_reward/s": 0.0,
                "rollout/prm_turn_reward/s__count": 3.0,
                "eval-rollout/prm_metric/turn/s/m/count": 1.0,
                "rollout/prm_turn_reward/z": math.nan,
                "rollout/prm_turn_reward/z__count": 1.0,
                "rollout/prm_turn_reward/e": 1.0,
                "rollout/prm_turn_reward/e__count": 0.0,
            },
        ]
    )
    assert merged["rollout/prm_turn_reward/s"] == 0.25
    # summed under the key as given: the namespace is stripped only to classify the key
    assert merged["rollout/prm_metric/turn/s/m/count"] == 2.0
    assert merged["eval-rollout/prm_metric/turn/s/m/count"] == 1.0
    assert "prm_metric/turn/s/m/count" not in merged
    assert math.isnan(merged["rollout/prm_turn_reward/z"])  # no validation: NaN passes
    assert "rollout/prm_turn_reward/e" not in merged  # sum of counts 0: omitted
    assert not any(k.endswith("__count") for k in merged)
    assert "rollout/other" not in merged and "rollout/prm_metric/turn/s/m/rate" not in merged  # mean without count


def test_merge_worker_stats_omits_a_mean_unless_its_count_sum_is_positive() -> None:
    from shaper.metrics import merge_worker_stats

    key = "rollout/prm_metric/turn/s/m/rate"
    merged = merge_worker_stats(
        [
            {
                key: 1.0,
                f"{key}__count": -2.0,
                "rollout/prm_turn_reward/s": 0.5,
                "rollout/prm_turn_reward/s__count": -1.0,
            },
            {key: 0.5, f"{key}__count": 1.0, "rollout/prm_turn_reward/s": 0.5, "rollout/prm_turn_reward/s__count": 3.0},
            {"rollout/prm_metric/trajectory/s/m/sum": 2.5, "rollout/prm_metric/trajectory/s/m/observed_count": 1.0},
            {"rollout/prm_metric/trajectory/s/m/sum": -1.0},
        ]
    )
    assert key not in merged  # count sum -1: AReaL keeps a mean only when the sum is > 0
    assert merged["rollout/prm_turn_reward/s"] == 0.5  # (0.5 * -1 + 0.5 * 3) / 2
    assert merged["rollout/prm_metric/trajectory/s/m/sum"] == 1.5
    assert merged["rollout/prm_metric/trajectory/s/m/observed_count"] == 1.0


def test_merge_stats_edge_cases_as_areal() -> None:
    from shaper.metrics import merge_stats

    merged = merge_stats(
        [{"m": 1.0, "m__count": 1.0}, {"m": 7.0}, {"m": math.nan, "m__count": 0.0}, {"c": 2.0}, {"c": 3.0}]
    )
    # a mean weighted only by the count in its own dict; one without a count carries no weight
    assert math.isnan(merged["m"])  # NaN * 0 = NaN, as AReaL's unvalidated merge
    merged = merge_stats([{"m": 1.0, "m__count": 1.0}, {"m": 7.0}, {"c": 2.0}, {"c": 3.0}])
    assert merged == {"m": 1.0, "m__count": 1.0, "c": 5.0}


# ----------------------------------------------------------------------------- mask_no_eos_with_zero
def test_mask_no_eos_keeps_truncated_rows_in_the_loss_and_zeroes_their_rewards() -> None:
    import dataclasses

    from shaper.trainer import shape_batch
    from tests.unit.test_exclusion import cases_batch

    batch = cases_batch()
    n = batch.rewards.shape[0]
    batch = dataclasses.replace(
        batch,
        rewards=torch.arange(n, dtype=torch.float32),
        group_ids=["g"] * n,
        token_rewards=torch.where(batch.loss_mask, 0.5, 0.0),
        is_truncated=torch.tensor([True] + [False] * (n - 1)),
    )
    plain = shape_batch(batch, Shaping(mode="additive"))
    masked = shape_batch(batch, Shaping(mode="additive"), Trainer(), Actor(mask_no_eos_with_zero=True))
    assert torch.equal(masked.loss_mask, plain.loss_mask)  # truncated row 0 stays in the loss
    assert masked.token_rewards[0].abs().sum() == 0 and masked.token_rewards[1].abs().sum() > 0
    # row 0's outcome reward (0.0 here, already) is not placed; others keep theirs:
    # zeroing another row instead changes the group baseline
    moved = dataclasses.replace(batch, is_truncated=torch.tensor([False] * (n - 1) + [True]))
    shaped = shape_batch(moved, Shaping(mode="additive"), Trainer(), Actor(mask_no_eos_with_zero=True))
    expected = shape_batch(
        dataclasses.replace(
            moved,
            rewards=torch.tensor([*range(n - 1), 0.0]),
            token_rewards=torch.where(torch.arange(n)[:, None] == n - 1, 0.0, moved.token_rewards),
        ),
        Shaping(mode="additive"),
    )
    assert torch.equal(shaped.advantages, expected.advantages)
    assert shaped.loss_mask[n - 1].sum() > 0
