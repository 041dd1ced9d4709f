"""shaper.reward_client (pure: no broker): RewardClient's results say why in typed fields (the
verdict's ``reason_code`` comes with every SampleReward, next to the free-text ``reason``), and
``reduce_process`` is the one scalar trainers that take a number per sample get from process rewards."""

from __future__ import annotations

import numpy as np
import pytest

from infra.config import PipelineConfig
from infra.schema import GroupVerdict, SessionResult
from shaper.reward_client import RewardClient, Sample, SampleReward, reduce_process, rewards_for


def _trajectory():
    client = RewardClient(PipelineConfig())
    return client.trajectory(
        Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], outcome_reward=1.0),
        group_id="g",
        group_size=2,
        trajectory_id="g/t0",
    )


def test_a_rejected_group_gives_its_reason_code_and_text() -> None:
    trajectory, spans = _trajectory()
    failed = SessionResult.failure(
        code="scorer_timeout", detail="judge took > 60s", session_id="g/t0", trajectory_id="g/t0"
    )
    verdict = GroupVerdict(
        group_id="g",
        status="rejected",
        reason_code="scorer_timeout",
        reason="scorer_timeout: member 'g/t0' (session 'g/t0'): judge took > 60s",
        group_size=2,
        sessions=[failed],
    )
    reward = rewards_for(verdict, trajectory, spans, 3, group_id="g", timeout_s=1.0)
    assert (reward.status, reward.reason_code) == ("rejected", "scorer_timeout")
    assert reward.reason == verdict.reason
    assert reward.token_rewards.tolist() == [0.0, 0.0, 0.0]


def test_a_discarded_group_gives_the_discarded_code_whatever_its_text() -> None:
    trajectory, spans = _trajectory()
    verdict = GroupVerdict(group_id="g", status="discarded", reason_code="discarded", reason="prompt filtered")
    reward = rewards_for(verdict, trajectory, spans, 3, group_id="g", timeout_s=1.0)
    assert (reward.status, reward.reason_code, reward.reason) == ("discarded", "discarded", "prompt filtered")


def test_accepted_and_timed_out_carry_no_code() -> None:
    trajectory, spans = _trajectory()
    timed_out = rewards_for(None, trajectory, spans, 3, group_id="g", timeout_s=1.0)
    assert (timed_out.status, timed_out.reason_code) == ("timeout", "")
    assert "no verdict for group 'g'" in timed_out.reason
    scored = SessionResult(session_id="g/t0", trajectory_id="g/t0", status="scored", outcome_reward=1.0)
    accepted = rewards_for(
        GroupVerdict(group_id="g", status="accepted", group_size=1, sessions=[scored]),
        trajectory,
        spans,
        3,
        group_id="g",
        timeout_s=1.0,
    )
    assert (accepted.status, accepted.reason_code, accepted.reason) == ("accepted", "", "")


def reward(status: str = "accepted") -> SampleReward:
    # response: turn [0, 2), a tool token at 2 (never the model's), turn [3, 5)
    tokens = np.array([0.5, -0.25, 9.0, 1.0, 0.25], dtype=np.float32)
    return SampleReward("g", "g/t", status, "", 1.0, tokens, [0.125, 0.625], [(0, 2), (3, 5)])


@pytest.mark.parametrize(("how", "expected"), [("mean", 0.375), ("sum", 1.5), ("last", 0.25)])
def test_reductions_cover_only_generated_tokens(how: str, expected: float) -> None:
    assert reduce_process(reward(), how) == pytest.approx(expected)


@pytest.mark.parametrize("status", ["rejected", "discarded", "timeout"])
def test_no_process_scalar_without_an_accepted_verdict(status: str) -> None:
    assert reduce_process(reward(status), "sum") == 0.0


def test_unknown_reduction_is_refused() -> None:
    with pytest.raises(ValueError, match="'mean', 'sum' or 'last'"):
        reduce_process(reward(), "max")  # type: ignore[arg-type]
