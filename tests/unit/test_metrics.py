"""shaper.metrics: VerdictMetrics (AReaL's metric names merged count-weighted over verdicts) and
merge_stats (means weighted by counts, counts and sums added)."""

from __future__ import annotations

import math

import pytest

from shaper import merge_stats
from shaper.filters import FilterDecision
from shaper.metrics import VerdictMetrics, count_key, reason_key
from tests.unit.test_batch import T0, session, simple_session, verdict

TURN = "rollout/prm_turn_reward/len"
TRAJ = "rollout/prm_trajectory_reward/len"
RATE = "rollout/prm_metric/turn/len/over_budget/rate"
COUNT = "rollout/prm_metric/turn/len/over_budget/count"
OBSERVED = "rollout/prm_metric/turn/len/over_budget/observed_count"


def stats(turn_mean: float, turns: int, *, rate: float = 0.0, true: int = 0) -> dict[str, float]:
    """A worker's per-session stats dict, as ScoredTrajectory.stats() writes it."""
    return {
        TURN: turn_mean,
        TURN + "__count": float(turns),
        TRAJ: turn_mean * turns,
        TRAJ + "__count": 1.0,
        RATE: rate,
        RATE + "__count": float(turns),
        COUNT: float(true),
        OBSERVED: float(turns),
    }


def test_means_are_weighted_by_observation_counts_across_sessions() -> None:
    m = VerdictMetrics()
    m.observe(
        verdict(
            "g1",
            [
                simple_session("a", stats=stats(1.0, 1, rate=1.0, true=1)),
                simple_session("b", stats=stats(0.0, 3, rate=0.0)),
            ],
        )
    )
    out = m.drain()
    assert out[TURN] == pytest.approx(0.25) and out[TURN + "__count"] == 4.0  # not (1 + 0) / 2
    assert out[RATE] == pytest.approx(0.25) and out[RATE + "__count"] == 4.0
    assert out[TRAJ] == pytest.approx(0.5) and out[TRAJ + "__count"] == 2.0
    assert out[COUNT] == 1.0 and out[OBSERVED] == 4.0  # counts are added
    assert out["pipeline/verdicts/accepted"] == 1.0


def test_rejected_groups_scored_members_count_failed_members_do_not() -> None:
    m = VerdictMetrics()
    scored = simple_session("ok", stats=stats(0.5, 2))
    # A failed member never carries stats on the wire; even if one did, it must not count.
    failed = session("bad", [T0], status="failed", stats=stats(100.0, 50))
    m.observe(verdict("g", [scored, failed], status="rejected", reason="scorer_error: boom", code="scorer_error"))
    out = m.drain()
    assert out[TURN] == pytest.approx(0.5) and out[TURN + "__count"] == 2.0
    assert out["pipeline/verdicts/rejected"] == 1.0
    assert out["pipeline/verdicts/rejected/scorer_error"] == 1.0
    assert "pipeline/verdicts/accepted" not in out


def test_discarded_and_missing_sessions_are_counted_by_reason_code() -> None:
    m = VerdictMetrics()
    for k in range(3):  # three discards, three different texts: one series, keyed by the code
        m.observe(
            verdict(f"g1-{k}", [], status="discarded", reason=f"environment crashed before turn {k}", code="discarded")
        )
    m.observe(
        verdict(
            "g2",
            [simple_session("x", stats=stats(1.0, 1))],
            status="rejected",
            reason="missing_sessions: 1 of 2 arrived before the deadline",
            code="missing_sessions",
        )
    )
    out = m.drain()
    assert out["pipeline/verdicts/discarded"] == 3.0
    assert out["pipeline/verdicts/discarded/discarded"] == 3.0
    assert not [k for k in out if "environment" in k or "%20" in k]  # the text never becomes a key
    assert out["pipeline/verdicts/rejected/missing_sessions"] == 1.0
    assert out[TURN + "__count"] == 1.0


def test_eval_namespace_stays_separate() -> None:
    m = VerdictMetrics()
    eval_stats = {k.replace("rollout/", "eval-rollout/", 1): v for k, v in stats(0.9, 1).items()}
    m.observe(verdict("g", [simple_session("a", stats=stats(0.1, 1)), simple_session("b", stats=eval_stats)]))
    out = m.drain()
    assert out[TURN] == pytest.approx(0.1) and out["eval-rollout/prm_turn_reward/len"] == pytest.approx(0.9)


def test_drain_starts_a_new_window_totals_keep_everything() -> None:
    m = VerdictMetrics()
    m.observe(verdict("g1", [simple_session("a", stats=stats(1.0, 1))]))
    m.count("verdicts/duplicate")
    m.record_filter(FilterDecision(True, "mixed"))
    first = m.drain()
    assert first["pipeline/verdicts/duplicate"] == 1.0
    assert first["pipeline/filter/accepted_mixed"] == 1.0
    m.observe(verdict("g2", [simple_session("b", stats=stats(0.0, 1))]))
    m.record_filter(FilterDecision(False, "all_correct"))
    second = m.drain()
    assert second[TURN] == 0.0 and second[TURN + "__count"] == 1.0
    assert "pipeline/verdicts/duplicate" not in second and "pipeline/filter/accepted_mixed" not in second
    assert second["pipeline/filter/rejected_by_all_correct"] == 1.0
    total = m.totals()
    assert total[TURN] == pytest.approx(0.5) and total[TURN + "__count"] == 2.0
    assert total["pipeline/verdicts/accepted"] == 2.0
    assert total["pipeline/filter/accepted_mixed"] == 1.0 and total["pipeline/filter/rejected_by_all_correct"] == 1.0
    assert m.drain() == {}


def test_invalid_stats_are_skipped_and_counted() -> None:
    m = VerdictMetrics()
    m.observe(
        verdict(
            "g",
            [
                simple_session("a", stats={TURN: math.nan, TURN + "__count": 1.0}),
                simple_session("b", stats=stats(0.5, 1)),
            ],
        )
    )
    out = m.drain()
    assert out["pipeline/stats_invalid"] == 1.0
    assert out[TURN] == 0.5 and out[TURN + "__count"] == 1.0


def test_reason_key_is_the_registered_code_never_the_text() -> None:
    assert (
        reason_key(verdict("g", [], "rejected", "scorer_timeout: took 60s", code="scorer_timeout")) == "scorer_timeout"
    )
    assert reason_key(verdict("g", [], "rejected", "missing_sessions: 1 of 2")) == "unspecified"  # no code: old writer
    assert reason_key(verdict("g", [], "rejected", "x", code="not_a_known_code")) == "other"
    assert reason_key(verdict("g", [], "accepted")) == ""


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
