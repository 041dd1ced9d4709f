"""Pure parts of the verl integration, and what verl's own types make of a :class:`PRMScore`."""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from shaper.integrations.verl import PRMScore, compute_prm_grpo_advantage, shaping_options, split_rewards, turn_spans


@pytest.mark.parametrize(
    ("mask", "valid_len", "spans"),
    [
        (None, 4, [(0, 4)]),
        ([1, 1, 0, 1, 0, 0], 4, [(0, 2), (3, 4)]),
        ([0, 1, 1, 0, 0, 1], 6, [(1, 3), (5, 6)]),  # leading tool tokens join the first turn's prompt
        ([1, 1, 1, 1], 2, [(0, 2)]),  # padding beyond the valid length is ignored
        ([0, 0, 0], 3, [(0, 0)]),  # nothing generated: one empty turn
    ],
)
def test_turn_spans(mask, valid_len, spans) -> None:
    assert turn_spans(None if mask is None else np.array(mask), valid_len) == spans


def test_split_rewards_puts_everything_from_the_last_generated_token_on_in_the_outcome() -> None:
    rewards = torch.tensor([[0.5, -0.25, 0.0, 0.5, 1.0, 0.0],
                            [0.1, 0.2, 0.0, 0.0, 0.7, 0.0],    # ends with a tool token carrying the outcome
                            [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])   # no generated token at all
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    outcome, process = split_rewards(rewards, mask)
    torch.testing.assert_close(outcome.sum(-1), torch.tensor([1.0, 0.7, 3.0]))
    torch.testing.assert_close(process, torch.tensor([[0.5, -0.25, 0, 0.5, 0, 0], [0.1, 0.2, 0, 0, 0, 0], [0.0] * 6]))
    torch.testing.assert_close(outcome + process, rewards)


def test_prm_score_is_a_float_that_survives_pickling() -> None:
    score = PRMScore(0.75, np.array([0.5, -0.25], np.float32), "accepted")
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, pickle.loads)):
        again = loads(dumps(score))
        assert isinstance(again, PRMScore) and again == 0.75 and again.status == "accepted"
        np.testing.assert_array_equal(again.token_rewards, score.token_rewards)
    assert torch.tensor([score, 1.0]).tolist() == [0.75, 1.0]  # what verl's agent loop does with scores


def test_verls_agent_loop_output_takes_a_prm_score_as_its_reward() -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], metrics=AgentLoopMetrics(),
                          reward_score=PRMScore(1.0, np.array([0.5, 0.5], np.float32), "accepted"))
    assert out.as_dict()["rm_scores"].tolist() == [0.0, 1.0]  # verl places only the float: see the docs


def test_shaping_options_defaults_overrides_and_unknown_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRM_CONFIG", raising=False)
    assert shaping_options(None) == {"mode": "additive", "negative_scale": 0.2, "zero_penalty": 0.4, "zero_eps": 1e-6}
    assert shaping_options(OmegaConf.create({"prm_shaping": {"mode": "gvpo", "zero_penalty": 1.0}}))["zero_penalty"] == 1.0
    with pytest.raises(ValueError, match="unknown keys"):
        shaping_options({"prm_shaping": {"mdoe": "gvpo"}})


def test_process_weighted_rejects_rewards_outside_0_1() -> None:
    rewards = torch.tensor([[2.0, 1.0], [0.5, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="process_weighted"):  # the range check raises as AReaL does
        compute_prm_grpo_advantage(rewards, mask, np.array(["g", "g"], dtype=object),
                                   config={"prm_shaping": {"mode": "process_weighted"}})


def test_missing_group_index_is_an_error() -> None:
    with pytest.raises(ValueError, match="uid"):
        compute_prm_grpo_advantage(torch.zeros(1, 2), torch.ones(1, 2), None)
