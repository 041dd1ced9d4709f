"""Member tags in a float32 reward: exact round trips, a bounded perturbation, no false matches."""

from __future__ import annotations

import numpy as np
import pytest

from infra.schema import GroupVerdict, SessionResult
from shaper.reward_tags import MAX_MEMBERS, member_by_tag, member_tag, read_tag, tag_reward, tagged_matches

OUTCOMES = [1.0, 0.0, -1.0, 0.5, 0.1, -0.3, 3.7, 1e-3, 12345.678]


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_every_tag_round_trips_and_stays_within_255_ulp(outcome: float) -> None:
    base = np.float32(outcome)
    ulp = float(np.spacing(np.abs(base))) if base != 0 else float(np.finfo(np.float32).smallest_subnormal)
    for tag in range(1, MAX_MEMBERS + 1):
        value = tag_reward(outcome, tag)
        assert np.float32(value) == value  # exactly a float32: verl's float32 rm_scores keep it
        assert read_tag(value) == tag and tagged_matches(value, outcome)
        assert abs(value - float(base)) <= MAX_MEMBERS * ulp
        assert value != 0.0  # the reader finds the reward slot as the row's last nonzero value


def test_relative_perturbation_is_below_3_1e_5() -> None:
    worst = max(abs(tag_reward(o, t) - float(np.float32(o))) / abs(o) for o in OUTCOMES if o for t in (1, 255))
    assert worst < 3.1e-5


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_tag_zero_rounds_the_outcome_so_it_reads_as_no_member(outcome: float) -> None:
    value = tag_reward(outcome, 0)
    assert read_tag(value) == 0 and abs(value - outcome) <= 1.6e-5 * abs(outcome) + 1e-7
    if float(np.float32(outcome)) in (1.0, 0.0, -1.0, 0.5):
        assert value == outcome  # the usual outcomes are exact


def test_another_members_outcome_does_not_match() -> None:
    assert not tagged_matches(tag_reward(1.0, 2), 0.0)
    assert not tagged_matches(tag_reward(1.0, 2), 1.0 + 1e-3)


def test_bad_tags_and_outcomes_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        tag_reward(1.0, 256)
    with pytest.raises(ValueError, match="finite"):
        tag_reward(float("nan"), 1)


def test_member_rank_is_by_trajectory_id_whatever_the_session_order() -> None:
    sessions = [SessionResult(session_id=t, trajectory_id=t, status="scored", outcome_reward=1.0) for t in "cab"]
    verdict = GroupVerdict(group_id="g", status="accepted", sessions=sessions)
    assert [member_tag(verdict, t) for t in "abc"] == [1, 2, 3]
    assert member_tag(verdict, "zz") == 0 and member_tag(None, "a") == 0
    assert member_by_tag(verdict, 2).trajectory_id == "b" and member_by_tag(verdict, 4) is None
