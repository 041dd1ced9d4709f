"""Decision-path tests for shaper.filters (AReaL's Process Rewards, "Branches, Filtering And Metrics")."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shaper import filters
from shaper.filters import (
    FILTERS,
    FilterCounters,
    FilterDecision,
    get_filter,
)
from shaper.filters import (
    decide_mixed_or_penalized_all_wrong as filter_mixed_or_penalized_all_wrong,
)
from shaper.filters import (
    decide_mixed_or_penalized_all_wrong_mask_no_eos as filter_mixed_or_penalized_all_wrong_mask_no_eos,
)

BOTH = [filter_mixed_or_penalized_all_wrong, filter_mixed_or_penalized_all_wrong_mask_no_eos]


def group(rewards: list[float], token_rewards: list[list[float]] | None = None, **extra) -> dict:
    out: dict = {"rewards": torch.tensor(rewards)}
    if token_rewards is not None:
        out["token_rewards"] = torch.tensor(token_rewards)
        out.setdefault("loss_mask", torch.ones_like(out["token_rewards"], dtype=torch.bool))
        # Default: every row finished early (attention shorter than the padded width).
        out["attention_mask"] = torch.tensor([[1] * (len(row) - 1) + [0] for row in token_rewards])
    for key, value in extra.items():
        out[key] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


@pytest.mark.parametrize("flt", BOTH)
class TestDecisionPaths:
    def test_mixed_kept(self, flt) -> None:
        decision = flt(group([1.0, 0.0, 1.0], [[0.0, 0.0]] * 3))
        assert decision == FilterDecision(True, "mixed")
        assert decision

    def test_mixed_all_non_positive_is_still_mixed(self, flt) -> None:
        assert flt(group([0.0, -1.0])).reason == "mixed"

    def test_all_correct_rejected_even_with_penalty(self, flt) -> None:
        decision = flt(group([1.0, 1.0], [[0.0, -1.0], [0.0, 0.0]]))
        assert decision == FilterDecision(False, "all_correct")
        assert not decision

    def test_all_wrong_with_penalty_kept(self, flt) -> None:
        decision = flt(group([0.0, 0.0], [[0.0, 0.0, 0.0], [0.0, -0.5, 0.0]]))
        assert decision == FilterDecision(True, "penalized_all_wrong")

    def test_all_wrong_negative_rewards_with_penalty_kept(self, flt) -> None:
        assert flt(group([-1.0, -1.0], [[-0.1, 0.0], [0.0, 0.0]])).reason == "penalized_all_wrong"

    def test_all_wrong_without_penalty_rejected(self, flt) -> None:
        decision = flt(group([0.0, 0.0], [[0.0, 0.5], [1.0, 0.0]]))
        assert decision == FilterDecision(False, "all_wrong")

    def test_all_wrong_without_token_rewards_rejected(self, flt) -> None:
        assert flt(group([0.0, 0.0], attention_mask=[[1, 0], [1, 0]])).reason == "all_wrong"

    def test_penalty_outside_loss_mask_ignored(self, flt) -> None:
        g = group([0.0, 0.0], [[-1.0, 0.0], [0.0, 0.0]], loss_mask=[[0, 1], [1, 1]])
        assert flt(g) == FilterDecision(False, "all_wrong")

    def test_original_rewards_preferred(self, flt) -> None:
        # normalised rewards look mixed, the raw outcome is all-correct
        g = group([0.5, -0.5], original_rewards=[1.0, 1.0])
        assert flt(g).reason == "all_correct"

    def test_single_member_group(self, flt) -> None:
        assert flt(group([1.0])).reason == "all_correct"
        assert flt(group([0.0], [[0.0, -1.0]])).reason == "penalized_all_wrong"

    @pytest.mark.parametrize(
        "g",
        [
            {},
            {"rewards": torch.tensor([])},
            {"rewards": torch.tensor([0.0, math.nan])},
            {"original_rewards": torch.tensor([math.inf, 1.0]), "rewards": torch.tensor([1.0, 1.0])},
            {"original_rewards": None, "rewards": torch.tensor([1.0, 0.0])},  # present None: no fallback
        ],
    )
    def test_bad_rewards(self, flt, g) -> None:
        with pytest.raises(ValueError, match="rewards"):
            flt(g)

    def test_token_rewards_rows_not_checked_against_rewards_as_in_areal(self, flt) -> None:
        assert flt(group([0.0, 0.0], [[0.0, -1.0]], attention_mask=[[1, 0]])).reason == "penalized_all_wrong"

    def test_rewards_of_any_shape_are_flattened(self, flt) -> None:
        assert flt({"rewards": torch.tensor([[1.0], [0.0]])}).reason == "mixed"


class TestMaskNoEos:
    def test_truncated_penalty_ignored_via_is_truncated(self) -> None:
        g = group([0.0, 0.0], [[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]], is_truncated=[True, False])
        assert filter_mixed_or_penalized_all_wrong(g) == FilterDecision(True, "penalized_all_wrong")
        assert filter_mixed_or_penalized_all_wrong_mask_no_eos(g) == FilterDecision(False, "all_wrong")

    def test_untruncated_penalty_still_counts(self) -> None:
        g = group([0.0, 0.0], [[0.0, -1.0, 0.0], [0.0, 0.0, -2.0]], is_truncated=[True, False])
        assert filter_mixed_or_penalized_all_wrong_mask_no_eos(g).reason == "penalized_all_wrong"

    def test_truncated_penalty_ignored_via_attention_length(self) -> None:
        # row 0 fills the padded width (3) -> truncated; row 1 ended early
        g = group(
            [0.0, 0.0],
            [[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]],
            attention_mask=[[1, 1, 1], [1, 1, 0]],
        )
        assert filter_mixed_or_penalized_all_wrong(g).keep
        assert filter_mixed_or_penalized_all_wrong_mask_no_eos(g) == FilterDecision(False, "all_wrong")

    def test_attention_rule_keeps_finished_row_penalty(self) -> None:
        g = group(
            [0.0, 0.0],
            [[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]],
            attention_mask=[[1, 1, 0], [1, 1, 1]],
        )
        assert filter_mixed_or_penalized_all_wrong_mask_no_eos(g).reason == "penalized_all_wrong"

    def test_is_truncated_overrides_attention_rule(self) -> None:
        g = group(
            [0.0, 0.0],
            [[0.0, -1.0, 0.0], [0.0, 0.0, 0.0]],
            attention_mask=[[1, 1, 1], [1, 1, 1]],
            is_truncated=[False, False],
        )
        assert filter_mixed_or_penalized_all_wrong_mask_no_eos(g).reason == "penalized_all_wrong"

    def test_truncation_does_not_change_outcome_classification(self) -> None:
        g = group([1.0, 0.0], [[0.0, 0.0], [0.0, 0.0]], is_truncated=[True, True])
        assert filter_mixed_or_penalized_all_wrong_mask_no_eos(g).reason == "mixed"

    def test_needs_truncation_information(self) -> None:
        g = {
            "rewards": torch.zeros(2),
            "token_rewards": torch.full((2, 2), -1.0),
            "loss_mask": torch.ones(2, 2),
            "is_truncated": torch.tensor([False, False]),
        }  # AReaL: attention_mask needed even then
        with pytest.raises(ValueError, match="requires attention_mask"):
            filter_mixed_or_penalized_all_wrong_mask_no_eos(g)


class TestDecisionAndRegistry:
    def test_decision_is_frozen(self) -> None:
        decision = FilterDecision(True, "mixed")
        with pytest.raises(dataclasses.FrozenInstanceError):
            decision.keep = False  # type: ignore[misc]

    def test_registry(self) -> None:
        assert set(FILTERS) == {
            "filter_mixed_or_penalized_all_wrong",
            "filter_mixed_or_penalized_all_wrong_mask_no_eos",
        }
        assert get_filter("filter_mixed_or_penalized_all_wrong") is filter_mixed_or_penalized_all_wrong
        with pytest.raises(ValueError, match="filter_mixed_or_penalized_all_wrong_mask_no_eos"):
            get_filter("nope")

    def test_counters(self) -> None:
        counters = FilterCounters()
        for reason, keep in [
            ("mixed", True),
            ("mixed", True),
            ("penalized_all_wrong", True),
            ("all_correct", False),
            ("all_wrong", False),
            ("all_wrong", False),
            ("all_wrong", False),
        ]:
            counters.record(FilterDecision(keep, reason))
        assert counters.as_dict() == {
            "rejected_by_failed_or_perfect": 4,
            "rejected_by_all_correct": 1,
            "rejected_by_all_wrong": 3,
            "accepted_penalized_all_wrong": 1,
            "accepted_mixed": 2,
        }
        with pytest.raises(ValueError, match="unknown filter decision reason"):
            counters.record(FilterDecision(False, "bogus"))

    def test_counters_with_real_filters(self) -> None:
        counters = FilterCounters()
        for g in (group([1.0, 0.0]), group([1.0, 1.0]), group([0.0, 0.0], [[-1.0], [0.0]])):
            counters.record(filters.decide_mixed_or_penalized_all_wrong(g))
        assert counters.as_dict() == {
            "rejected_by_failed_or_perfect": 1,
            "rejected_by_all_correct": 1,
            "rejected_by_all_wrong": 0,
            "accepted_penalized_all_wrong": 1,
            "accepted_mixed": 1,
        }
