"""shaper.metrics.VerdictMetrics: AReaL's metric names merged count-weighted over verdicts."""

from __future__ import annotations

import math

import pytest

from shaper.filters import FilterDecision
from shaper.metrics import VerdictMetrics, reason_key
from tests.unit.test_batch import T0, session, simple_session, verdict

TURN = "rollout/prm_turn_reward/len"
TRAJ = "rollout/prm_trajectory_reward/len"
RATE = "rollout/prm_metric/turn/len/over_budget/rate"
COUNT = "rollout/prm_metric/turn/len/over_budget/count"
OBSERVED = "rollout/prm_metric/turn/len/over_budget/observed_count"


def stats(turn_mean: float, turns: int, *, rate: float = 0.0, true: int = 0) -> dict[str, float]:
    """A worker's per-session stats dict, as ScoredTrajectory.stats() writes it."""
    return {
        TURN: turn_mean, TURN + "__count": float(turns),
        TRAJ: turn_mean * turns, TRAJ + "__count": 1.0,
        RATE: rate, RATE + "__count": float(turns),
        COUNT: float(true), OBSERVED: float(turns),
    }


def test_means_are_weighted_by_observation_counts_across_sessions() -> None:
    m = VerdictMetrics()
    m.observe(verdict("g1", [simple_session("a", stats=stats(1.0, 1, rate=1.0, true=1)),
                             simple_session("b", stats=stats(0.0, 3, rate=0.0))]))
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
        m.observe(verdict(f"g1-{k}", [], status="discarded", reason=f"environment crashed before turn {k}",
                          code="discarded"))
    m.observe(verdict("g2", [simple_session("x", stats=stats(1.0, 1))], status="rejected",
                      reason="missing_sessions: 1 of 2 arrived before the deadline", code="missing_sessions"))
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
    m.observe(verdict("g", [simple_session("a", stats={TURN: math.nan, TURN + "__count": 1.0}),
                            simple_session("b", stats=stats(0.5, 1))]))
    out = m.drain()
    assert out["pipeline/stats_invalid"] == 1.0
    assert out[TURN] == 0.5 and out[TURN + "__count"] == 1.0


def test_reason_key_is_the_registered_code_never_the_text() -> None:
    assert reason_key(verdict("g", [], "rejected", "scorer_timeout: took 60s", code="scorer_timeout")) == \
        "scorer_timeout"
    assert reason_key(verdict("g", [], "rejected", "missing_sessions: 1 of 2")) == "unspecified"  # no code: old writer
    assert reason_key(verdict("g", [], "rejected", "x", code="not_a_known_code")) == "other"
    assert reason_key(verdict("g", [], "accepted")) == ""
