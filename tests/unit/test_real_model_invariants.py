"""Invariants checked against a real model's tokens and log-probs (the tiny Llama of the demo).

* alignment: before any weight change, the log-probs the trainer recomputes for the
  batch's ``input_ids`` equal the behaviour ``logprobs`` at every ``loss_mask`` position
  (single-turn, multi-turn, branching sessions), so every importance ratio is 1;
* teacher signal: the OPD token signal equals teacher log-prob - rollout log-prob
  computed directly with the model on the hinted prompt, first output token included;
* rewards land on the right tokens: a scorer's per-token rewards appear exactly on its
  turn's output positions in the batch, and nowhere else.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infra.schema import ReadyTrajectory
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from prm_pipeline.demo.policy_update import PolicyUpdate
from scoring_workers.judge.prompts import append_hint_to_messages
from scoring_workers.scorers.opd import OPDTeacherScorer
from shaper import shift_token_rewards
from tests import real_model
from tests.real_model import one_torch_thread  # noqa: F401 - autouse fixture

TOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sessions(kind: str) -> list[ReadyTrajectory]:
    proxy = real_model.proxy(seed={"single": 1, "multi": 2, "branching": 3}[kind])
    turns, branch = {"single": (1, False), "multi": (3, False), "branching": (3, True)}[kind]
    return [proxy.session(f"g-{kind}", i, "compute 2 + 3", turns=turns, branch=branch) for i in range(2)]


@pytest.mark.parametrize("kind", ["single", "multi", "branching"])
async def test_recomputed_logprobs_equal_behaviour_logprobs_on_every_loss_token(kind: str) -> None:
    sessions = _sessions(kind)
    expected_rows = sum(
        len({i.interaction_id for i in s.interactions} - {i.parent_id for i in s.interactions}) for s in sessions
    )
    batch = await real_model.batch(f"g-{kind}", sessions)
    assert batch.batch_size == expected_rows == (4 if kind == "branching" else 2)
    update = PolicyUpdate(real_model.policy().model)
    new, old, mask = update.recompute(batch)
    # the shift keeps every output token (none sits at position 0: a prompt precedes it)
    assert int(mask.sum()) == int(batch.loss_mask.sum()) > 0
    diff = (new - old).abs()[mask]
    assert float(diff.max()) <= TOL, f"max |recomputed - behaviour| = {float(diff.max()):.2e}"
    # every importance ratio of the first minibatch is 1
    ratio = torch.exp(new - old)[mask]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4)


async def test_an_off_by_one_shift_would_be_caught() -> None:
    """The check has teeth: comparing without the shift differs by whole nats."""
    batch = await real_model.batch("g-shift", _sessions("multi"))
    new, _old, mask = PolicyUpdate(real_model.policy().model).recompute(batch)
    unshifted = batch.logprobs
    assert float((new - unshifted).abs()[mask].max()) > 0.1


async def test_rewards_land_on_their_turns_output_positions() -> None:
    sessions = _sessions("branching")
    batch = await real_model.batch("g-rewards", sessions)
    ids = batch.input_ids.float()
    mask = batch.loss_mask
    # TokenIdScorer rewards each output token with its own id + 0.5
    assert torch.equal(batch.token_rewards[mask], ids[mask] + 0.5)
    assert not batch.token_rewards[~mask].any()
    # and each turn's rewards sit at [len(input_k), len(input_k) + output_len_k) of its row
    by_id = {i.interaction_id: i for s in sessions for i in s.interactions}
    for row, leaf in enumerate(batch.leaf_ids):
        path = [leaf]
        while by_id[path[-1]].parent_id is not None:
            path.append(by_id[path[-1]].parent_id)
        for k, iid in enumerate(reversed(path)):
            mr = by_id[iid].model_response
            start, n = len(mr.input_tokens), len(mr.output_tokens)
            assert torch.equal(batch.turn_index[row, start : start + n], torch.full((n,), k))
            assert np.array_equal(batch.token_rewards[row, start : start + n].numpy(), mr.output_tokens + 0.5)
            assert np.array_equal(batch.logprobs[row, start : start + n].numpy(), mr.output_logprobs)
    # after the trainer's shift, reward t names the token at t + 1 (what the logits at t predict)
    shifted, smask = shift_token_rewards(batch.token_rewards), shift_token_rewards(mask)
    assert torch.equal(shifted[smask], ids[:, 1:][smask[:, :-1]] + 0.5)


async def test_opd_signal_is_teacher_minus_rollout_logprob_on_the_hinted_prompt() -> None:
    from prm_pipeline.demo.model_server import ModelServer

    policy = real_model.policy()
    for seed in range(4, 64):  # a first turn the environment answers negatively: the hint judge gives a hint
        session = real_model.proxy(seed=seed).session("g-opd", 0, "compute 2 + 3", turns=2, branch=False)
        first, second = session.interactions
        if any(w in second.messages[-1]["content"] for w in ("error", "wrong")):
            break
    else:
        pytest.fail("no session with a negative environment answer in 60 seeds")
    with FakeJudgeServer() as judge, ModelServer(policy) as teacher:
        scorer = OPDTeacherScorer(base_url=judge.base_url, teacher_base_url=teacher.base_url, m=1, temperature=0.0)
        try:
            ctx = {"messages": [*second.messages, *second.output_message_list]}
            result = await scorer.evaluate_result(first, ctx)
        finally:
            await scorer.aclose()
    hint = result.audit["hint"]
    assert hint, result.audit
    prompt = policy.template.render(append_hint_to_messages(first.messages, hint))
    out = first.model_response.output_tokens.tolist()
    teacher_lp = np.asarray(policy.prompt_logprobs(prompt + out)[len(prompt) :], dtype=np.float32)
    expected = teacher_lp - first.model_response.output_logprobs
    got = result.reward.numpy()
    assert got.shape == (len(out),)
    assert np.abs(got - expected).max() <= TOL, np.abs(got - expected).max()
    assert abs(got[0] - expected[0]) <= TOL  # the first output token is included
    assert np.abs(expected).max() > 1e-3  # the hint changes the teacher: the signal is not trivially 0


async def test_alignment_and_a_step_on_the_machines_accelerator() -> None:
    """Sampling (KV cache) and the trainer's recompute on the same device agree to 1e-5; a step runs there."""
    from prm_pipeline.demo.rollout_proxy import RolloutConfig, RolloutProxy
    from prm_pipeline.demo.tiny_model import TinyPolicy

    policy = TinyPolicy.create()
    policy.model.to(DEVICE)
    proxy = RolloutProxy(policy, RolloutConfig(group_size=2, seed=6))
    sessions = [proxy.session("g-dev", i, "compute 4 + 4", turns=3, branch=(i == 1)) for i in range(2)]
    batch = await real_model.batch("g-dev", sessions)
    update = PolicyUpdate(policy.model)
    new, old, mask = update.recompute(batch)
    assert new.device.type == DEVICE
    assert float((new - old).abs()[mask].max()) <= TOL
    advantages = torch.where(mask, torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE), 0.0)
    stats = update.step(batch, advantages, mask)
    assert stats.alignment_max_abs_diff <= TOL
    assert stats.tokens == int(mask.sum()) and np.isfinite(stats.loss)
    assert stats.ratio_min < 1.0 < stats.ratio_max  # the second minibatch saw moved weights
