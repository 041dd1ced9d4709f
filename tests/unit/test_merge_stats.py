"""Tests for shaper.metrics.merge_stats: means weighted by counts, counts and sums added."""

from __future__ import annotations

import math

import pytest

from shaper import merge_stats
from shaper.metrics import count_key


def test_mean_weighted_by_counts() -> None:
    merged = merge_stats([{"m": 1.0, "m__count": 1}, {"m": 0.0, "m__count": 3}])
    assert merged == {"m": 0.25, "m__count": 4.0}


def test_sums_and_counts_added() -> None:
    merged = merge_stats(
        [
            {"prm_metric/turn/len/over/sum": 2.0, "prm_metric/turn/len/over/count": 3},
            {"prm_metric/turn/len/over/sum": 5.5, "prm_metric/turn/len/over/count": 1},
        ]
    )
    assert merged == {"prm_metric/turn/len/over/sum": 7.5, "prm_metric/turn/len/over/count": 4.0}


def test_mixed_keys_and_disjoint_workers() -> None:
    merged = merge_stats(
        [
            {"rate": 0.5, "rate__count": 2, "n": 1},
            {"other": 3.0},
            {"rate": 1.0, "rate__count": 6, "n": 2},
        ]
    )
    assert merged == {"rate": 0.875, "rate__count": 8.0, "n": 3.0, "other": 3.0}
    assert list(merged) == ["rate", "rate__count", "n", "other"]  # first-seen order


def test_worker_with_zero_count_has_no_weight() -> None:
    merged = merge_stats([{"m": 123.0, "m__count": 0}, {"m": 2.0, "m__count": 2}])
    assert merged == {"m": 2.0, "m__count": 2.0}


def test_zero_total_count_omits_mean_keeps_count() -> None:
    merged = merge_stats([{"m": 0.0, "m__count": 0}, {"m__count": 0}])
    assert merged == {"m__count": 0.0}


def test_count_only_worker_contributes_count() -> None:
    merged = merge_stats([{"m__count": 0}, {"m": 4.0, "m__count": 2}])
    assert merged == {"m__count": 2.0, "m": 4.0}


def test_empty_inputs() -> None:
    assert merge_stats([]) == {}
    assert merge_stats([{}, {}]) == {}


def test_accepts_generator_and_does_not_mutate() -> None:
    a = {"m": 1.0, "m__count": 1}
    merged = merge_stats(d for d in [a, {"m": 3.0, "m__count": 1}])
    assert merged == {"m": 2.0, "m__count": 2.0}
    assert a == {"m": 1.0, "m__count": 1}


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_values_pass_through_as_areal(bad: float) -> None:
    merged = merge_stats([{"x": 1.0}, {"x": bad}])
    assert math.isnan(merged["x"]) if math.isnan(bad) else merged["x"] == bad


def test_non_numeric_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        merge_stats([{"x": 1.0}, {"x": object()}])  # type: ignore[dict-item]


def test_mean_without_its_count_carries_no_weight_as_areal() -> None:
    assert merge_stats([{"m": 1.0, "m__count": 1}, {"m": 0.5}]) == {"m": 1.0, "m__count": 1.0}


def test_count_key() -> None:
    assert count_key("prm_turn_reward/length") == "prm_turn_reward/length__count"
