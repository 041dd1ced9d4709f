"""The verl integration against real verl 0.9.1, the embedded broker + Redis and two worker processes.

Two groups x 2 samples (one multi-turn sample with a tool token, one truncated) reach
:class:`PRMRewardManager` along both of verl's reward paths, and then verl's own
``compute_advantage`` with ``adv_estimator="prm_grpo"``:

* the colocated reward-model path: ``run_single`` on one-row slices of a ``DataProto``,
  concurrently, then the class's ``assemble_rm_scores`` (what ``RewardLoopManager.compute_rm_score``
  does);
* the agent-loop path, verl's default: verl's own ``AgentLoopWorker._agent_loop_postprocess``
  (which calls ``_compute_score`` -> verl's ``RewardLoopWorker.compute_score`` -> our
  ``run_single``) and ``AgentLoopWorker._postprocess`` build ``rm_scores`` from the floats
  (the legacy trainer); and ``_compute_score`` + ``AgentLoopOutput.as_dict()`` as the v1
  trainer's ``AgentLoopWorkerTQ`` uses them (v1's TransferQueue module is not installed
  here; its ``compute_advantage_for_multi_trajectories`` hands a registered estimator to
  the same ``compute_advantage``).

Every expected number is worked out by hand below.

The worker scores with ``TokenParityScorer``: +0.5 for an even token id, -0.25 for an
odd one. The outcome is verl's: 1.0 when the ground truth "7" is a word of the decoded
response.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics
from shaper.integrations import verl as verl_adapter
from shaper.integrations.verl import (
    ESTIMATOR_NAME,
    MANAGER_NAME,
    PRMRewardManager,
    VerdictTimeout,
    close_verdict_lookups,
    recover_rewards,
)
from shaper.reward_tags import read_tag, tag_reward, tagged_matches
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
    return isolated_config(
        f"verl-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        scorer_timeout_s=5,
        group_timeout_s=GROUP_TIMEOUT_S,
        allowed_scorer_modules=[*TEST_SCORER_MODULES, "tests.ecosystem"],
        scorers=[PRMScorerConfig("tests.ecosystem.scorers.TokenParityScorer")],
    )


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


@pytest.fixture(scope="module", autouse=True)
def _close_driver_lookups():
    yield
    close_verdict_lookups()


def verl_config(prm_yaml: Path, **reward_kwargs) -> object:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": {"n": 2, "response_length": 6}},
            "reward": {
                "reward_kwargs": {"prm_config": str(prm_yaml), **reward_kwargs},
                "custom_reward_function": {"path": None},
                "reward_model": {"enable": False},
            },
            "algorithm": {"adv_estimator": ESTIMATOR_NAME, "use_kl_in_reward": False},
        }
    )


def objects(values: list) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def make_batch(uids: list[str]) -> DataProto:
    """Prompt width 3 (left-padded), response width 6 (right-padded)."""
    prompts = torch.tensor([[11, 12, 13], [0, 21, 22], [31, 32, 33], [31, 32, 33]])
    responses = torch.tensor(
        [
            [7, 4, 2, 0, 0, 0],  # one turn
            [8, 9, 5, 6, 3, 0],  # turn [8, 9], tool token [5], turn [6, 3]
            [7, 1, 2, 0, 0, 0],  # one turn
            [7, 6, 4, 4, 2, 1],  # one turn filling the width (truncated)
        ]
    )
    prompt_attention = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    response_attention = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1] * 6])
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1] * 6])

    n = len(uids)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts[:n],
            "responses": responses[:n],
            "attention_mask": torch.cat([prompt_attention, response_attention], dim=1)[:n],
            "response_mask": response_mask[:n],
        },
        non_tensors={
            "uid": objects(uids),
            "data_source": objects(["unit"] * n),
            "reward_model": objects([{"ground_truth": "7"} for _ in range(n)]),
            "raw_prompt": objects([[{"role": "user", "content": f"prompt {i}"}] for i in range(n)]),
        },
    )


PROMPTS = [[11, 12, 13], [21, 22], [31, 32, 33], [31, 32, 33]]
RESPONSES = [[7, 4, 2], [8, 9, 5, 6, 3], [7, 1, 2], [7, 6, 4, 4, 2, 1]]
MASKS = [[1, 1, 1], [1, 1, 0, 1, 1], [1, 1, 1], [1] * 6]
A = 0.5 / (math.sqrt(0.5) + 1e-6)  # group A outcomes [1, 0]: verl's GRPO (r - 0.5) / (unbiased std + eps) = +-A
# Group B outcomes [1, 1]: advantage 0. Additive: A + P on response_mask positions only; every generated
# token carries its process reward (TokenParityScorer: +0.5 even id, -0.25 odd id), the last one included.
ADDITIVE = torch.tensor(
    [
        [A - 0.25, A + 0.5, A + 0.5, 0, 0, 0],  # 7 4 2
        [-A + 0.5, -A - 0.25, 0, -A + 0.5, -A - 0.25, 0],  # 8 9 | tool 5 | 6 3
        [-0.25, -0.25, 0.5, 0, 0, 0],  # 7 1 2
        [-0.25, 0.5, 0.5, 0.5, 0.5, -0.25],  # 7 6 4 4 2 1
    ]
)
# gvpo on tokens with P < 0: A > eps -> 0; A < -eps -> 1.2 A; |A| <= eps -> -0.4. Others keep A.
GVPO = torch.tensor(
    [
        [0, A, A, 0, 0, 0],
        [-A, -1.2 * A, 0, -A, -1.2 * A, 0],
        [-0.4, -0.4, 0, 0, 0, 0],
        [-0.4, 0, 0, 0, 0, -0.4],
    ]
)


async def score(manager: PRMRewardManager, data: DataProto) -> list[dict]:
    """What verl's RewardLoopWorker.compute_score_batch does: one task per one-row slice."""
    return await asyncio.gather(*(manager.run_single(data[i : i + 1]) for i in range(len(data))))


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


def test_manager_returns_the_outcome_tagged_with_its_member(scored) -> None:
    _, outputs, _ = scored
    infos = [o["reward_extra_info"] for o in outputs]
    assert [i["prm_status"] for i in infos] == ["accepted"] * 4
    assert [i["prm_outcome"] for i in infos] == [1.0, 0.0, 1.0, 1.0]  # verl's outcome, untouched
    scores = [o["reward_score"] for o in outputs]
    assert all(type(s) is float for s in scores)  # verl's agent loop requires a float
    for s, info in zip(scores, infos):
        assert read_tag(s) == info["prm_member"] in (1, 2)
        assert tagged_matches(s, info["prm_outcome"]) and abs(s - info["prm_outcome"]) < 1e-5
    assert {infos[0]["prm_member"], infos[1]["prm_member"]} == {1, 2}  # the two members of group A differ
    assert [i["prm_process_reward"] for i in infos] == pytest.approx([0.75, 0.5, 0.0, 1.5])


def test_rm_scores_hold_the_tagged_outcome_at_the_last_valid_token(scored) -> None:
    _, outputs, rm_scores = scored
    for row, out, last in zip(rm_scores, outputs, [2, 4, 2, 5]):
        assert torch.count_nonzero(row) == 1 and row[last].item() == out["reward_score"]


def _with_rewards(data: DataProto, rm_scores: torch.Tensor) -> DataProto:
    data = DataProto.from_dict(tensors=dict(data.batch.items()), non_tensors=dict(data.non_tensor_batch))
    data.batch["token_level_scores"] = rm_scores
    data.batch["token_level_rewards"] = rm_scores
    return data


def _algorithm(prm_yaml: Path, mode: str, **extra) -> object:
    return OmegaConf.create(
        {
            "adv_estimator": ESTIMATOR_NAME,
            "norm_adv_by_std_in_grpo": True,
            "use_kl_in_reward": False,
            "prm_config": str(prm_yaml),
            "prm_verdict_wait_s": 10,
            "prm_shaping": {"mode": mode},
            **extra,
        }
    )


@pytest.mark.parametrize(("mode", "expected"), [("additive", ADDITIVE), ("gvpo", GVPO)])
def test_colocated_path_compute_advantage_with_prm_grpo(scored, prm_yaml: Path, mode: str, expected) -> None:
    data, _, rm_scores = scored
    out = compute_advantage(
        _with_rewards(data, rm_scores), adv_estimator=ESTIMATOR_NAME, config=_algorithm(prm_yaml, mode)
    )
    torch.testing.assert_close(out.batch["advantages"], expected)
    torch.testing.assert_close(out.batch["returns"], expected)


def test_process_weighted_refuses_rewards_outside_0_1(scored, prm_yaml: Path) -> None:
    data, _, rm_scores = scored
    with pytest.raises(RuntimeError, match="process_weighted"):  # the range check raises as AReaL does
        compute_advantage(
            _with_rewards(data, rm_scores),
            adv_estimator=ESTIMATOR_NAME,
            config=_algorithm(prm_yaml, "process_weighted"),
        )


def test_prm_grpo_outcome_part_is_verls_grpo_on_the_exact_outcomes(scored, prm_yaml: Path) -> None:
    data, outputs, rm_scores = scored
    exact = PRMRewardManager.assemble_rm_scores(data, [o["reward_extra_info"]["prm_outcome"] for o in outputs])
    algorithm = _algorithm(prm_yaml, "additive")
    outcome, process, tagged = recover_rewards(
        rm_scores,
        data.batch["response_mask"],
        data.non_tensor_batch["uid"],
        verl_adapter._verdicts(algorithm),
        wait_s=10,
    )
    assert tagged == 4
    torch.testing.assert_close(outcome, exact, rtol=0, atol=0)  # the tags are gone, bit for bit
    ours = compute_advantage(_with_rewards(data, rm_scores), adv_estimator=ESTIMATOR_NAME, config=algorithm)
    verls = compute_advantage(_with_rewards(data, exact), adv_estimator="grpo", config=algorithm)
    mask = data.batch["response_mask"]
    torch.testing.assert_close(ours.batch["advantages"] - process * mask, verls.batch["advantages"])


def test_kl_in_reward_is_refused(scored, prm_yaml: Path) -> None:
    data, _, rm_scores = scored
    algorithm = OmegaConf.create({"use_kl_in_reward": True})
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        compute_advantage(_with_rewards(data, rm_scores), adv_estimator=ESTIMATOR_NAME, config=algorithm)
    with pytest.raises(ValueError, match="use_kl_in_reward"):  # and at start-up, by the manager
        config = verl_config(prm_yaml)
        config.algorithm.use_kl_in_reward = True
        PRMRewardManager(config, DigitsTokenizer(), contains_ground_truth)


def test_dapo_filtering_on_the_tagged_reward_is_refused_at_start_up(prm_yaml: Path) -> None:
    config = verl_config(prm_yaml)
    config.algorithm.filter_groups = {"enable": True, "metric": "reward"}
    with pytest.raises(ValueError, match="filter_groups.metric=prm_outcome"):
        PRMRewardManager(config, DigitsTokenizer(), contains_ground_truth)


def test_a_tag_that_does_not_decode_is_an_error(scored, prm_yaml: Path) -> None:
    data, outputs, rm_scores = scored
    swapped = rm_scores.clone()
    other = outputs[1]["reward_extra_info"]["prm_member"]  # row 0 (outcome 1) claims row 1's member (outcome 0)
    swapped[0, 2] = tag_reward(1.0, other)
    with pytest.raises(RuntimeError, match="does not decode as a member"):
        compute_advantage(
            _with_rewards(data, swapped), adv_estimator=ESTIMATOR_NAME, config=_algorithm(prm_yaml, "additive")
        )
    stranger = rm_scores.clone()
    stranger[2, 2] = 0.1  # float32(0.1) ends in 0xCD: it reads as tag 205 of a group that has no verdict
    data = _with_rewards(data, stranger)
    data.non_tensor_batch["uid"] = objects(["x", "x", f"nobody-{uuid.uuid4().hex[:6]}", "x"])
    with pytest.raises(RuntimeError, match="no verdict for that group arrived within 0.5s"):
        compute_advantage(
            data, adv_estimator=ESTIMATOR_NAME, config=_algorithm(prm_yaml, "additive", prm_verdict_wait_s=0.5)
        )


def test_first_batch_without_any_tag_is_refused(scored, prm_yaml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, outputs, _ = scored
    plain = PRMRewardManager.assemble_rm_scores(data, [o["reward_extra_info"]["prm_outcome"] for o in outputs])
    monkeypatch.setattr(verl_adapter, "_seen_tagged", False)
    with pytest.raises(RuntimeError, match="refusing to train plain GRPO"):
        compute_advantage(
            _with_rewards(data, plain), adv_estimator=ESTIMATOR_NAME, config=_algorithm(prm_yaml, "additive")
        )


async def test_missing_verdict_is_reported_never_a_silent_zero(prm_yaml: Path) -> None:
    """Group of 2 with 1 member sent: our wait (0.5 s) ends before the workers' deadline."""
    data = make_batch([f"gC-{uuid.uuid4().hex[:6]}"])
    manager = PRMRewardManager(verl_config(prm_yaml, verdict_timeout_s=0.5), DigitsTokenizer(), contains_ground_truth)
    strict = PRMRewardManager(
        verl_config(prm_yaml, verdict_timeout_s=0.5, on_timeout="raise"), DigitsTokenizer(), contains_ground_truth
    )
    try:
        (out,) = await score(manager, data)
        with pytest.raises(VerdictTimeout, match="no verdict"):
            await score(strict, make_batch([f"gE-{uuid.uuid4().hex[:6]}"]))
    finally:
        await manager.aclose()
        await strict.aclose()
    info = out["reward_extra_info"]
    assert info["prm_status"] == "timeout" and "within 0.5s" in info["prm_reason"]
    assert out["reward_score"] == 1.0 and info["prm_member"] == 0  # verl's outcome stays, untagged
    assert info["prm_process_reward"] == 0.0
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
    assert info["prm_process_reward"] == 0.0
    assert tagged_matches(out["reward_score"], 1.0)  # tagged when the verdict lists the member, exact otherwise


# --------------------------------------------------------------------------- verl's agent-loop path
def digit_tokenizer():
    """A real Hugging Face tokenizer built in code (no download): token ``"k"`` has id k; pad is 100."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(100)} | {"<pad>": 100}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
    )


def agent_loop_worker(manager: PRMRewardManager, config) -> object:
    """verl's AgentLoopWorker with only what post-processing reads, its reward handle a RewardLoopWorker.

    The handle stands in for the Ray actor handle (``compute_score.remote(data)`` is awaited);
    behind it runs verl's own ``RewardLoopWorker.compute_score``, which calls ``run_single``.
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    reward_worker = RewardLoopWorker.__new__(RewardLoopWorker)
    reward_worker.config, reward_worker.reward_manager = config, manager
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.reward_loop_worker_handles = [
        SimpleNamespace(compute_score=SimpleNamespace(remote=reward_worker.compute_score))
    ]
    worker.rollout_config = SimpleNamespace(prompt_length=3, response_length=6)
    worker.tokenizer, worker.processor, worker.mm_processor_kwargs = digit_tokenizer(), None, {}
    worker.distillation_enabled = False
    return worker


def agent_outputs() -> list:
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    return [
        AgentLoopOutput(prompt_ids=p, response_ids=r, response_mask=m, num_turns=2, metrics=AgentLoopMetrics())
        for p, r, m in zip(PROMPTS, RESPONSES, MASKS)
    ]


def sample_kwargs(uid: str, i: int) -> dict:
    return {
        "uid": uid,
        "data_source": "unit",
        "reward_model": {"ground_truth": "7"},
        "raw_prompt": [{"role": "user", "content": f"prompt {i}"}],
    }


async def test_agent_loop_path_legacy_trainer(prm_yaml: Path) -> None:
    """verl's per-sample and batch post-processing build rm_scores from the floats; prm_grpo gets the rest."""
    config = verl_config(prm_yaml, verdict_timeout_s=30)
    manager = PRMRewardManager(config, digit_tokenizer(), contains_ground_truth)
    worker = agent_loop_worker(manager, config)
    tag = uuid.uuid4().hex[:6]
    uids = [f"lA-{tag}", f"lA-{tag}", f"lB-{tag}", f"lB-{tag}"]
    try:
        internal = await asyncio.gather(
            *(
                worker._agent_loop_postprocess(out, False, **sample_kwargs(uid, i))
                for i, (out, uid) in enumerate(zip(agent_outputs(), uids))
            )
        )
    finally:
        await manager.aclose()
    batch = worker._postprocess(list(internal), input_non_tensor_batch=None, validate=False)
    assert list(batch.non_tensor_batch["prm_status"]) == ["accepted"] * 4
    assert batch.meta_info["reward_extra_keys"][-6:] == [
        "prm_status",
        "prm_reason",
        "prm_process_reward",
        "prm_verdict_wait_s",
        "prm_outcome",
        "prm_member",
    ]
    assert torch.count_nonzero(batch.batch["rm_scores"]) == 4  # one float per sample, as verl writes it
    batch.non_tensor_batch["uid"] = objects(uids)  # what the trainer's union with the prompt batch adds
    rewards = batch.batch["rm_scores"]
    for mode, expected in (("additive", ADDITIVE), ("gvpo", GVPO)):
        out = compute_advantage(
            _with_rewards(batch, rewards), adv_estimator=ESTIMATOR_NAME, config=_algorithm(prm_yaml, mode)
        )
        torch.testing.assert_close(out.batch["advantages"], expected)


async def test_agent_loop_path_v1_trainer(prm_yaml: Path) -> None:
    """verl's default (trainer.use_v1): _compute_score per sample with its session_id, as_dict(), then the estimator.

    AgentLoopWorkerTQ stores each ``as_dict()`` in TransferQueue; the trainer reads the rows back
    right-padded (``to_padded_tensor``), as the jagged tensors below are.
    """
    config = verl_config(prm_yaml, verdict_timeout_s=30)
    manager = PRMRewardManager(config, digit_tokenizer(), contains_ground_truth)
    worker = agent_loop_worker(manager, config)
    tag = uuid.uuid4().hex[:6]
    uids = [f"vA-{tag}", f"vA-{tag}", f"vB-{tag}", f"vB-{tag}"]
    outputs = agent_outputs()
    try:
        await asyncio.gather(
            *(
                worker._compute_score([out], kwargs={**sample_kwargs(uid, i), "session_id": i % 2})
                for i, (out, uid) in enumerate(zip(outputs, uids))
            )
        )
    finally:
        await manager.aclose()
    fields = [out.as_dict() for out in outputs]
    assert [f["extra_fields"]["reward_extra_info"]["prm_status"] for f in fields] == ["accepted"] * 4

    def padded(key: str) -> torch.Tensor:
        return torch.nested.as_nested_tensor([f[key] for f in fields], layout=torch.jagged).to_padded_tensor(0)

    batch = DataProto.from_dict(
        tensors={"response_mask": padded("response_mask"), "rm_scores": padded("rm_scores")},
        non_tensors={"uid": objects(uids)},
    )
    out = compute_advantage(
        _with_rewards(batch, batch.batch["rm_scores"]),
        adv_estimator=ESTIMATOR_NAME,
        config=_algorithm(prm_yaml, "additive"),
    )
    torch.testing.assert_close(out.batch["advantages"], ADDITIVE)
