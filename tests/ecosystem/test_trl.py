"""The TRL integration against real TRL 1.16.0: ``GRPOTrainer.train()`` on CPU, rewards through the pipeline.

A tiny ``LlamaForCausalLM`` built from a config and a word-level tokenizer built in code
(no downloads, ``HF_HUB_OFFLINE=1``) train for two steps with TRL's own
``GRPOTrainer``; every completion TRL samples is published to the embedded broker and
scored by two worker processes with ``TokenParityScorer`` (+0.5 for an even token id,
-0.25 for an odd one). The completions are random, so each test records the token ids
TRL generated and works the expected numbers out by hand from them — the parity
rewards, TRL's group normalisation, the shaping rule — independently of the adapter's
code.
"""

from __future__ import annotations

import asyncio
import math
import os
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from infra.config import PipelineConfig
from infra.kafka import ensure_topics
from shaper.integrations.trl import PRMGRPOTrainer, PRMRewardFunction, groups_of
from tests.ecosystem.parity import parity_config
from tests.integration.harness import isolated_config, worker_processes

pytestmark = pytest.mark.integration

EVEN, ODD = 0.5, -0.25
WORDS = ["[PAD]", "[EOS]", "[UNK]", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"]
PROMPTS = ["a b c", "d e", "f g h", "i j"]


def parity(ids: list[int]) -> list[float]:
    return [EVEN if i % 2 == 0 else ODD for i in ids]


def first_token_outcome(completion_ids, **_) -> list[float]:
    """The outcome: 1 when the completion starts with a token id divisible by 3."""
    return [1.0 if ids and ids[0] % 3 == 0 else 0.0 for ids in completion_ids]


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(WORDS),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
    )


def grpo_args(tmp: Path) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(tmp),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        temperature=1.0,
        bf16=False,
        dataloader_num_workers=0,
    )


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return parity_config("trl", kafka_bootstrap, redis_url)


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("trl-workers")) as procs:
        yield procs


class RecordingReward(PRMRewardFunction):
    """The adapter's reward function, keeping what TRL passed in and what it got back."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[list[int]], list[float], list]] = []

    async def __call__(self, prompts, completions, completion_ids, **kwargs):
        values = await super().__call__(prompts, completions, completion_ids, **kwargs)
        self.calls.append(([list(c) for c in completion_ids], values, list(self.last)))
        return values


async def test_reward_function_trains_grpo_with_pipeline_rewards(cfg, workers, tmp_path) -> None:
    tok = tokenizer()
    reward = RecordingReward(cfg, tokenizer=tok, group_size=2, outcome=first_token_outcome, verdict_timeout_s=60)
    trainer = GRPOTrainer(
        model=model(tok),
        reward_funcs=[reward],
        args=grpo_args(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tok,
    )
    try:
        await asyncio.to_thread(trainer.train)
    finally:
        asyncio.run_coroutine_threadsafe(reward.aclose(), trainer.async_loop).result(30)
    assert trainer.state.global_step == 2
    assert len(reward.calls) == 2  # one reward call per generation batch
    for completion_ids, values, results in reward.calls:
        assert [r.status for r in results] == ["accepted"] * 4
        for ids, value, result in zip(completion_ids, values, results):
            assert result.token_rewards.tolist() == parity(ids)  # the workers' rewards, on TRL's tokens
            expected = first_token_outcome([ids])[0] + (sum(parity(ids)) / len(ids) if ids else 0.0)
            assert value == pytest.approx(expected, abs=1e-6)
    # What TRL recorded as this function's rewards (its log keeps the last step) is what we returned.
    assert list(trainer._logs["rewards"]["prm"]) == pytest.approx(reward.calls[-1][1], abs=1e-6)


class RecordingTrainer(PRMGRPOTrainer):
    """The adapter's trainer, keeping every generation batch it hands to TRL's loss."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[dict] = []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.batches.append({k: output[k].clone() for k in ("completion_ids", "completion_mask", "advantages")})
        return output


def outcome_advantages(rewards: list[float], group_size: int) -> list[float]:
    """TRL's default (``scale_rewards="group"``): (r - group mean) / (group std with Bessel + 1e-4)."""
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out.extend((r - mean) / (std + 1e-4) for r in group)
    return out


def shaped(a: float, p: float, mode: str) -> float:
    if mode == "additive":
        return a + p
    if p >= 0:  # gvpo: only failed tokens (P < 0) change
        return a
    return -0.4 if abs(a) <= 1e-6 else (a * 1.2 if a < 0 else 0.0)


@pytest.mark.parametrize("mode", ["additive", "gvpo"])
async def test_subclass_trains_on_token_advantages(cfg, workers, tmp_path, mode) -> None:
    tok = tokenizer()
    trainer = RecordingTrainer(
        model=model(tok),
        reward_funcs=[first_token_outcome],
        args=grpo_args(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tok,
        prm_config=cfg,
        shaping={"mode": mode},
        verdict_timeout_s=60,
    )
    await asyncio.to_thread(trainer.train)
    assert trainer.state.global_step == 2
    assert trainer.prm_counts == {"accepted": 8}
    assert [x["prm/accepted"] for x in trainer.state.log_history if "prm/accepted" in x] == [1.0, 1.0]
    assert len(trainer.batches) == 2
    for batch in trainer.batches:
        ids = batch["completion_ids"].tolist()
        mask = batch["completion_mask"].tolist()
        got = batch["advantages"]
        assert got.shape == batch["completion_ids"].shape  # (B, T): per-token advantages reach TRL's loss
        lengths = [sum(m) for m in mask]
        completions = [row[:n] for row, n in zip(ids, lengths)]
        adv = outcome_advantages(first_token_outcome(completions), 2)
        for i, row in enumerate(completions):
            rewards = parity(row)
            expected = [shaped(adv[i], rewards[t], mode) if t < len(row) else adv[i] for t in range(len(ids[i]))]
            assert got[i].tolist() == pytest.approx(expected, abs=1e-5), (mode, i, row)
    assert all(math.isfinite(x["loss"]) for x in trainer.state.log_history if "loss" in x)


async def test_a_late_verdict_keeps_the_outcome_and_is_counted(kafka_bootstrap, redis_url) -> None:
    """No workers on this config: the group times out, the function says so and returns the outcome alone."""
    cfg = isolated_config(f"trl-late-{uuid.uuid4().hex[:8]}", kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    metrics: dict[str, float] = {}
    reward = PRMRewardFunction(
        cfg, tokenizer=tokenizer(), group_size=2, outcome=first_token_outcome, verdict_timeout_s=1.0
    )
    try:
        values = await reward(["a b", "a b"], ["", ""], [[3, 4], [4, 5]], log_metric=metrics.__setitem__)
    finally:
        await reward.aclose()
    assert values == [1.0, 0.0]  # outcome only: no process rewards, no silent zero reward either
    assert [r.status for r in reward.last] == ["timeout", "timeout"]
    assert "within 1s" in reward.last[0].reason
    assert metrics == {"prm/accepted": 0.0, "prm/timeout": 1.0}


def test_groups_must_be_whole_blocks_of_one_prompt() -> None:
    assert groups_of(4, 2, ["p", "p", "q", "q"]) == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        groups_of(3, 2, ["p", "p", "q"])
    with pytest.raises(ValueError, match="prompts differ"):
        groups_of(4, 2, ["p", "q", "q", "p"])
