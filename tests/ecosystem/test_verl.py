"""The verl integration against real verl 0.9.1, the embedded broker + Redis and two worker processes.

A real ``DataProto`` batch (2 GRPO groups x 2 samples, one multi-turn sample with a
tool gap, one truncated) goes through :class:`PRMRewardManager` the way verl's Reward
Loop drives a manager (``run_single`` on one-row slices, concurrently, then the class's
``assemble_rm_scores``), and then through verl's own ``compute_advantage`` with
``adv_estimator="prm_grpo"``. Every expected number is worked out by hand below.

The worker scores with ``TokenParityScorer``: +0.5 for an even token id, -0.25 for an
odd one. The outcome is verl's: 1.0 when the ground truth "7" is a word of the decoded
response.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics
from shaper.integrations.verl import ESTIMATOR_NAME, MANAGER_NAME, PRMRewardManager, PRMScore, VerdictTimeout
from tests.integration.harness import TEST_SCORER_MODULES, WorkerProcesses, isolated_config, write_config

pytestmark = pytest.mark.integration

GROUP_TIMEOUT_S = 4.0  # the workers reject a group still missing members after this long


class DigitsTokenizer:
    """What the naive manager needs from a tokenizer (``decode``), with no files to download."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


def contains_ground_truth(data_source, solution_str, ground_truth, extra_info=None, **_):
    return 1.0 if ground_truth in solution_str.split() else 0.0


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return isolated_config(f"verl-{uuid.uuid4().hex[:8]}", kafka_bootstrap, redis_url, scorer_timeout_s=5,
                           group_timeout_s=GROUP_TIMEOUT_S,
                           allowed_scorer_modules=[*TEST_SCORER_MODULES, "tests.ecosystem"],
                           scorers=[PRMScorerConfig("tests.ecosystem.scorers.TokenParityScorer")])


@pytest.fixture(scope="module")
async def prm_yaml(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    await ensure_topics(cfg.kafka, cfg.topics)
    tmp = tmp_path_factory.mktemp("verl-workers")
    path = write_config(cfg, tmp / "prm.yaml")
    procs = WorkerProcesses(path, tmp, n=2)
    procs.start()
    yield path
    codes = procs.stop()
    assert codes == [0, 0], f"workers did not exit cleanly: {codes}\n{procs.logs()}"


def verl_config(prm_yaml: Path, **reward_kwargs) -> object:
    return OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "reward": {"reward_kwargs": {"prm_config": str(prm_yaml), **reward_kwargs}},
    })


def make_batch(uids: list[str]) -> DataProto:
    """Prompt width 3 (left-padded), response width 6 (right-padded)."""
    prompts = torch.tensor([[11, 12, 13], [0, 21, 22], [31, 32, 33], [31, 32, 33]])
    responses = torch.tensor([
        [7, 4, 2, 0, 0, 0],   # one turn
        [8, 9, 5, 6, 3, 0],   # turn [8, 9], tool token [5], turn [6, 3]
        [7, 1, 2, 0, 0, 0],   # one turn
        [7, 6, 4, 4, 2, 1],   # one turn filling the width (truncated)
    ])
    prompt_attention = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    response_attention = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1] * 6])
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1] * 6])

    def objects(values: list) -> np.ndarray:
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
        return arr

    n = len(uids)
    return DataProto.from_dict(
        tensors={"prompts": prompts[:n], "responses": responses[:n],
                 "attention_mask": torch.cat([prompt_attention, response_attention], dim=1)[:n],
                 "response_mask": response_mask[:n]},
        non_tensors={"uid": objects(uids), "data_source": objects(["unit"] * n),
                     "reward_model": objects([{"ground_truth": "7"} for _ in range(n)]),
                     "raw_prompt": objects([[{"role": "user", "content": f"prompt {i}"}] for i in range(n)])},
    )


async def score(manager: PRMRewardManager, data: DataProto) -> list[dict]:
    """What verl's RewardLoopWorker.compute_score_batch does: one task per one-row slice."""
    return await asyncio.gather(*(manager.run_single(data[i:i + 1]) for i in range(len(data))))


@pytest.fixture(scope="module")
async def scored(prm_yaml: Path):
    manager = PRMRewardManager(verl_config(prm_yaml, verdict_timeout_s=30), DigitsTokenizer(), contains_ground_truth)
    tag = uuid.uuid4().hex[:6]
    data = make_batch([f"gA-{tag}", f"gA-{tag}", f"gB-{tag}", f"gB-{tag}"])
    try:
        outputs = await score(manager, data)
    finally:
        await manager.aclose()
    # What verl's RewardLoopManager.compute_rm_score does with the results.
    rm_scores = PRMRewardManager.assemble_rm_scores(data, [o["reward_score"] for o in outputs])
    return data, outputs, rm_scores


def test_names_are_registered_with_verl() -> None:
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    assert get_reward_manager_cls(MANAGER_NAME) is PRMRewardManager
    assert get_adv_estimator_fn(ESTIMATOR_NAME).__name__ == "compute_prm_grpo_advantage"


def test_manager_returns_outcome_and_aligned_process_rewards(scored) -> None:
    _, outputs, _ = scored
    assert [o["reward_extra_info"]["prm_status"] for o in outputs] == ["accepted"] * 4
    scores = [o["reward_score"] for o in outputs]
    assert all(isinstance(s, PRMScore) for s in scores)
    assert [float(s) for s in scores] == [1.0, 0.0, 1.0, 1.0]  # verl's outcome, untouched
    expected = [
        [-0.25, 0.5, 0.5],                    # 7 4 2
        [0.5, -0.25, 0.0, 0.5, -0.25],        # 8 9 | tool 5 | 6 3 : two turns, 0 on the tool token
        [-0.25, -0.25, 0.5],                  # 7 1 2
        [-0.25, 0.5, 0.5, 0.5, 0.5, -0.25],   # 7 6 4 4 2 1
    ]
    for s, want in zip(scores, expected):
        np.testing.assert_array_equal(s.token_rewards, np.array(want, np.float32))
    assert outputs[1]["reward_extra_info"]["prm_process_reward"] == pytest.approx(0.5)


def test_rm_scores_carry_outcome_at_last_token_and_process_rewards_before_it(scored) -> None:
    _, _, rm_scores = scored
    expected = torch.tensor([
        [-0.25, 0.5, 1.0, 0, 0, 0],           # last token: the outcome 1.0 (its process reward is not carried)
        [0.5, -0.25, 0, 0.5, 0.0, 0],         # last generated token 3: outcome 0.0
        [-0.25, -0.25, 1.0, 0, 0, 0],
        [-0.25, 0.5, 0.5, 0.5, 0.5, 1.0],
    ])
    torch.testing.assert_close(rm_scores, expected, rtol=0, atol=0)


def _with_rewards(data: DataProto, rm_scores: torch.Tensor) -> DataProto:
    data = DataProto.from_dict(tensors=dict(data.batch.items()), non_tensors=dict(data.non_tensor_batch))
    data.batch["token_level_scores"] = rm_scores
    data.batch["token_level_rewards"] = rm_scores
    return data


def _algorithm(mode: str) -> object:
    return OmegaConf.create({"adv_estimator": ESTIMATOR_NAME, "norm_adv_by_std_in_grpo": True,
                             "use_kl_in_reward": False, "prm_shaping": {"mode": mode}})


def test_verl_compute_advantage_with_prm_grpo_additive(scored) -> None:
    data, _, rm_scores = scored
    out = compute_advantage(_with_rewards(data, rm_scores), adv_estimator=ESTIMATOR_NAME, config=_algorithm("additive"))
    # Group A outcomes [1, 0]: verl's GRPO = (r - 0.5) / (unbiased std sqrt(0.5) + 1e-6) = +-a.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    # Group B outcomes [1, 1]: advantage 0. Additive: A + P on response_mask positions only.
    expected = torch.tensor([
        [a - 0.25, a + 0.5, a, 0, 0, 0],
        [-a + 0.5, -a - 0.25, 0, -a + 0.5, -a, 0],
        [-0.25, -0.25, 0, 0, 0, 0],
        [-0.25, 0.5, 0.5, 0.5, 0.5, 0],
    ])
    torch.testing.assert_close(out.batch["advantages"], expected)
    torch.testing.assert_close(out.batch["returns"], expected)


def test_verl_compute_advantage_with_prm_grpo_gvpo(scored) -> None:
    data, _, rm_scores = scored
    out = compute_advantage(_with_rewards(data, rm_scores), adv_estimator=ESTIMATOR_NAME, config=_algorithm("gvpo"))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    # gvpo on tokens with P < 0: A > eps -> 0; A < -eps -> 1.2 A; |A| <= eps -> -0.4. Others keep A.
    expected = torch.tensor([
        [0, a, a, 0, 0, 0],
        [-a, -1.2 * a, 0, -a, -a, 0],
        [-0.4, -0.4, 0, 0, 0, 0],
        [-0.4, 0, 0, 0, 0, 0],
    ])
    torch.testing.assert_close(out.batch["advantages"], expected)


def test_prm_grpo_without_process_rewards_is_verls_grpo(scored) -> None:
    data, outputs, _ = scored
    outcome_only = PRMRewardManager.assemble_rm_scores(data, [float(o["reward_score"]) for o in outputs])
    ours = compute_advantage(_with_rewards(data, outcome_only), adv_estimator=ESTIMATOR_NAME,
                             config=_algorithm("additive"))
    verls = compute_advantage(_with_rewards(data, outcome_only), adv_estimator="grpo",
                              config=_algorithm("additive"))
    torch.testing.assert_close(ours.batch["advantages"], verls.batch["advantages"], rtol=0, atol=0)


def test_kl_in_reward_is_refused(scored) -> None:
    data, _, rm_scores = scored
    algorithm = OmegaConf.create({"use_kl_in_reward": True})
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        compute_advantage(_with_rewards(data, rm_scores), adv_estimator=ESTIMATOR_NAME, config=algorithm)


async def test_missing_verdict_is_reported_never_a_silent_zero(prm_yaml: Path) -> None:
    """Group of 2 with 1 member sent: our wait (0.5 s) ends before the workers' deadline."""
    data = make_batch([f"gC-{uuid.uuid4().hex[:6]}"])
    manager = PRMRewardManager(verl_config(prm_yaml, verdict_timeout_s=0.5), DigitsTokenizer(), contains_ground_truth)
    strict = PRMRewardManager(verl_config(prm_yaml, verdict_timeout_s=0.5, on_timeout="raise"), DigitsTokenizer(),
                              contains_ground_truth)
    try:
        (out,) = await score(manager, data)
        with pytest.raises(VerdictTimeout, match="no verdict"):
            await score(strict, make_batch([f"gE-{uuid.uuid4().hex[:6]}"]))
    finally:
        await manager.aclose()
        await strict.aclose()
    info = out["reward_extra_info"]
    assert info["prm_status"] == "timeout" and "within 0.5s" in info["prm_reason"]
    assert float(out["reward_score"]) == 1.0  # verl's outcome stays
    assert not out["reward_score"].token_rewards.any()
    assert manager.counts["timeout"] == 1


async def test_group_rejected_by_the_workers_is_reported(prm_yaml: Path) -> None:
    """Group of 2 with 1 member sent: the workers reject it at their deadline; we wait for that verdict."""
    data = make_batch([f"gD-{uuid.uuid4().hex[:6]}"])
    manager = PRMRewardManager(verl_config(prm_yaml, verdict_timeout_s=30), DigitsTokenizer(), contains_ground_truth)
    try:
        (out,) = await score(manager, data)
    finally:
        await manager.aclose()
    info = out["reward_extra_info"]
    assert info["prm_status"] == "rejected"
    assert info["prm_reason"].startswith("missing_sessions")
    assert GROUP_TIMEOUT_S - 1 <= info["prm_verdict_wait_s"] < 30
    assert not out["reward_score"].token_rewards.any()
