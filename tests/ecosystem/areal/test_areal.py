"""The AReaL integration against real AReaL 1.0.4 (its own environment: ``make test-ecosystem-areal``).

A two-turn agent runs on AReaL's own ``ArealOpenAI`` client (``chat_template_type="concat"``)
against a generation engine written for the test (``agenerate`` returns scripted tokens
with log-probs: no GPU, no model); the agent sets its outcome with ``set_reward`` and
returns ``export_interactions(style="concat")``, as AReaL's agent workflows do.
:class:`PRMRolloutWorkflow` runs two such episodes per data item, publishes them to the
embedded broker, two worker processes score them with ``TokenParityScorer`` (+0.5 for an
even token id, -0.25 for an odd one), and the test reads the result the way AReaL's
trainer does — ``to_tensor_dict()`` — with every expected number worked out by hand.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
from areal.api.io_struct import ModelResponse
from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai import ArealOpenAI
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import shaper.integrations.areal as adapter
from infra.config import PipelineConfig
from infra.kafka import ensure_topics
from shaper.integrations.areal import HAS_TOKEN_REWARDS_FIELD, PRMRolloutWorkflow, chain_of, sample_of
from tests.ecosystem.parity import parity_config
from tests.integration.harness import isolated_config, worker_processes

pytestmark = pytest.mark.integration

WORDS = ["[PAD]", "[EOS]", "[UNK]", "user", "assistant", "tool", "hi", "a", "b", "c", "d", "e", "f", "g"]
EOS = 1


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} [EOS] {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    return fast


class ScriptedEngine:
    """AReaL's ``agenerate`` contract with scripted outputs: each call answers the next script entry."""

    def __init__(self, outputs: list[list[int]]) -> None:
        self.outputs = list(outputs)
        self.requests: list[list[int]] = []

    async def agenerate(self, req: Any) -> ModelResponse:
        self.requests.append(list(req.input_ids))
        out = self.outputs.pop(0)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=out,
            output_logprobs=[-0.1 * (k + 1) for k in range(len(out))],
            output_versions=[7] * len(out),
            stop_reason="stop",
            tokenizer=req.tokenizer,
        )


class TwoTurnAgent(RolloutWorkflow):
    """Ask, get a tool result, answer; the outcome is 1 when the answer mentions token 'a'."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok = tok

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict:
        client = ArealOpenAI(engine=engine, tokenizer=self.tok, chat_template_type="concat")
        messages = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(messages=messages, max_completion_tokens=8)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "g"}]
        second = await client.chat.completions.create(messages=messages, max_completion_tokens=8)
        client.set_reward(second.id, 1.0 if "a" in (second.choices[0].message.content or "").split() else 0.0)
        return client.export_interactions(style="concat")


def parity(ids: list[int]) -> list[float]:
    return [0.5 if i % 2 == 0 else -0.25 for i in ids]


# Episode 1: "b c" [EOS], then "a d" [EOS] (outcome 1); episode 2: "e" [EOS], then "f b c" [EOS] (outcome 0).
SCRIPT = [[8, 9, EOS], [7, 10, EOS], [11, EOS], [12, 8, 9, EOS]]


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return parity_config("areal", kafka_bootstrap, redis_url)


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("areal-workers")) as procs:
        yield procs


async def run_group(workflow: PRMRolloutWorkflow, script=SCRIPT) -> tuple[dict | None, ScriptedEngine]:
    engine = ScriptedEngine(script)
    try:
        return await workflow.arun_episode(engine, {"question": "hi"}), engine
    finally:
        await workflow.aclose()


def test_areal_1_0_4_has_no_token_rewards_field() -> None:
    assert not HAS_TOKEN_REWARDS_FIELD  # the scalar path below is the one 1.0.4 users get


async def test_group_is_scored_and_rewards_reach_to_tensor_dict(cfg, workers) -> None:
    workflow = PRMRolloutWorkflow(
        TwoTurnAgent(tokenizer()),
        group_size=2,
        cfg=cfg,
        verdict_timeout_s=60,
        tensor_token_rewards=True,
        version=lambda: 7,
    )
    result, _ = await run_group(workflow)
    assert result is not None and len(result) == 2  # one concat leaf per episode
    assert workflow.counts == {"accepted": 2}
    leaves = list(result.values())
    outcomes = [1.0, 0.0]
    generated = [[8, 9, EOS, 7, 10, EOS], [11, EOS, 12, 8, 9, EOS]]  # both turns' outputs, in order
    # the engine's log-probs, -0.1 * (k + 1) for the k-th token of each turn
    per_turn_logprobs = [[-0.1, -0.2, -0.3, -0.1, -0.2, -0.3], [-0.1, -0.2, -0.1, -0.2, -0.3, -0.4]]
    for leaf, outcome, tokens, logprobs in zip(leaves, outcomes, generated, per_turn_logprobs):
        assert len(chain_of(leaf)) == 2  # the first turn is the leaf's parent
        td = leaf.to_tensor_dict()
        mask = td["loss_mask"][0].tolist()
        ids = td["input_ids"][0].tolist()
        assert [t for t, m in zip(ids, mask) if m] == tokens
        # 1.0.4: reward = outcome + mean process reward of the generated tokens
        expected = outcome + sum(parity(tokens)) / len(tokens)
        assert td["rewards"].tolist() == pytest.approx([expected])
        assert leaf.reward == pytest.approx(expected)
        # token_rewards rides along, aligned with input_ids: parity on generated tokens, 0 elsewhere
        want = [p if m else 0.0 for p, m in zip(parity(ids), mask)]
        assert td["token_rewards"][0].tolist() == pytest.approx(want)
        assert td["token_rewards"].shape == td["input_ids"].shape
        # AReaL's own fields are untouched: log-probs, versions
        assert [lp for lp, m in zip(td["logprobs"][0].tolist(), mask) if m] == pytest.approx(logprobs)
        assert set(v for v, m in zip(td["versions"][0].tolist(), mask) if m) == {7}


async def test_published_sample_carries_arealopenai_tokens_and_logprobs(cfg, workers) -> None:
    workflow = PRMRolloutWorkflow(TwoTurnAgent(tokenizer()), group_size=2, cfg=cfg, verdict_timeout_s=60)
    result, engine = await run_group(workflow)
    assert result is not None
    leaf = next(iter(result.values()))
    sample = sample_of(leaf)
    td = leaf.to_tensor_dict()
    prompt_len = len(sample.prompt_ids)
    assert list(sample.prompt_ids) + list(sample.response_ids) == td["input_ids"][0].tolist()
    assert engine.requests[0] == list(sample.prompt_ids)  # the first turn's prompt is the sample's prompt
    assert list(sample.response_mask) == td["loss_mask"][0].tolist()[prompt_len:]
    assert list(sample.response_logprobs) == pytest.approx(td["logprobs"][0].tolist()[prompt_len:])
    reward = workflow.last[next(iter(result))]
    assert reward.turn_rewards == pytest.approx([sum(parity([8, 9, EOS])) / 3, sum(parity([7, 10, EOS])) / 3])


async def test_token_rewards_field_when_areal_has_it(cfg, workers, monkeypatch) -> None:
    """AReaL's Process Rewards add ``token_rewards`` to the interaction: emulated here on 1.0.4's class."""
    monkeypatch.setattr(adapter, "HAS_TOKEN_REWARDS_FIELD", True)
    workflow = PRMRolloutWorkflow(TwoTurnAgent(tokenizer()), group_size=2, cfg=cfg, verdict_timeout_s=60)
    result, _ = await run_group(workflow)
    assert result is not None
    first, second = list(result.values())
    assert first.reward == 1.0 and second.reward == 0.0  # the outcome stays apart from process rewards
    parent, leaf = chain_of(first)
    assert parent.token_rewards.tolist() == pytest.approx(parity([8, 9, EOS]))  # per interaction, its own output
    assert leaf.token_rewards.tolist() == pytest.approx(parity([7, 10, EOS]))
    assert first.to_tensor_dict()["rewards"].tolist() == [1.0]


async def test_late_groups(kafka_bootstrap, redis_url) -> None:
    """No workers on this config: by default the group is rejected (None) — AReaL drops it; the other choices hold."""
    cfg = isolated_config(f"areal-late-{uuid.uuid4().hex[:8]}", kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    rejecting = PRMRolloutWorkflow(TwoTurnAgent(tokenizer()), group_size=2, cfg=cfg, verdict_timeout_s=1)
    result, _ = await run_group(rejecting)
    assert result is None
    assert rejecting.counts == {"timeout": 2}

    keeping = PRMRolloutWorkflow(
        TwoTurnAgent(tokenizer()), group_size=2, cfg=cfg, verdict_timeout_s=1, on_timeout="outcome_only"
    )
    result, _ = await run_group(keeping)
    assert result is not None
    assert [i.to_tensor_dict()["rewards"].item() for i in result.values()] == [1.0, 0.0]  # the workflow's own

    raising = PRMRolloutWorkflow(
        TwoTurnAgent(tokenizer()), group_size=2, cfg=cfg, verdict_timeout_s=1, on_timeout="raise"
    )
    with pytest.raises(adapter.VerdictTimeout, match="no verdict for group"):
        await run_group(raising)


async def test_a_workflow_that_does_not_export_interactions_is_refused() -> None:
    class TensorWorkflow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            return {"input_ids": torch.zeros(1, 3)}

    workflow = PRMRolloutWorkflow(TensorWorkflow(), group_size=1, cfg=PipelineConfig())
    with pytest.raises(TypeError, match="export_interactions"):
        await workflow.arun_episode(None, {})
