"""Pure parts of the verl integration, and what verl's own types make of a tagged reward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from shaper.integrations import verl as verl_adapter
from shaper.integrations.verl import compute_prm_grpo_advantage, recover_rewards, shaping_options
from shaper.reward_tags import read_tag, tag_reward


def test_verls_agent_loop_output_keeps_a_tagged_reward_bit_for_bit() -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    for outcome in (1.0, 0.0, 0.1, -1.0):
        value = tag_reward(outcome, 3)
        out = AgentLoopOutput(
            prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], metrics=AgentLoopMetrics(), reward_score=value
        )
        rm_scores = out.as_dict()["rm_scores"]  # verl places the float, as float32, at the last token
        assert rm_scores[0].item() == 0.0 and rm_scores[1].item() == value and read_tag(rm_scores[1].item()) == 3


def test_untagged_rows_pass_through_without_a_verdict_lookup() -> None:
    class NoLookup:
        def get(self, *_):
            raise AssertionError("no row is tagged: nothing to look up")

    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    outcome, process, tagged = recover_rewards(
        rewards, torch.ones(2, 3), np.array(["g", "g"], dtype=object), NoLookup(), wait_s=1
    )
    assert tagged == 0 and torch.equal(outcome, rewards) and not process.any()


def test_shaping_options_defaults_overrides_and_unknown_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRM_CONFIG", raising=False)
    assert shaping_options(None) == {"mode": "additive", "negative_scale": 0.2, "zero_penalty": 0.4, "zero_eps": 1e-6}
    assert (
        shaping_options(OmegaConf.create({"prm_shaping": {"mode": "gvpo", "zero_penalty": 1.0}}))["zero_penalty"] == 1.0
    )
    with pytest.raises(ValueError, match="unknown keys"):
        shaping_options({"prm_shaping": {"mdoe": "gvpo"}})


def test_first_batch_without_tags_is_refused_later_ones_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("PRM_CONFIG", raising=False)
    rewards, mask, index = torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2), np.array(["g", "g"], dtype=object)
    monkeypatch.setattr(verl_adapter, "_seen_tagged", False)
    with pytest.raises(RuntimeError, match="refusing to train plain GRPO"):
        compute_prm_grpo_advantage(rewards, mask, index)
    monkeypatch.setattr(verl_adapter, "_seen_tagged", True)
    advantages, _ = compute_prm_grpo_advantage(rewards, mask, index)
    assert "trains on outcomes only" in caplog.text
    assert advantages[0, 0] > 0 > advantages[1, 0]


def test_missing_group_index_is_an_error() -> None:
    with pytest.raises(ValueError, match="uid"):
        compute_prm_grpo_advantage(torch.zeros(1, 2), torch.ones(1, 2), None)
