"""TRL integration: a reward function for ``GRPOTrainer`` and ``PRMGRPOTrainer``, which puts process rewards on tokens.

The only module of the project that imports ``trl`` (tested against TRL 1.16.0; see
docs/integrations/trl.md). Two ways in, both thin layers over
:class:`shaper.reward_client.RewardClient`:

* :class:`PRMRewardFunction` — an async reward function for
  ``GRPOTrainer(reward_funcs=[...])``. TRL calls it with the batch's prompts and
  completion token ids; every consecutive block of ``group_size`` completions (TRL's
  layout: a prompt's generations are adjacent) is published as one group, and each
  completion gets ``outcome + reduction(process rewards)`` — one number, which TRL
  group-normalises like any reward. Prompt tokens are re-tokenized from the prompt text
  (TRL does not pass its prompt ids to reward functions).
* :class:`PRMGRPOTrainer` — a ``GRPOTrainer`` subclass that keeps TRL's outcome
  advantages (from your reward functions) and folds the per-token process rewards in
  with :func:`shaper.shaping.shape_advantages`, handing TRL's loss ``(B, T)``
  advantages (``_compute_loss`` accepts them). It publishes the exact prompt and
  completion ids TRL generated, the sampling log-probs when the backend returns them,
  and TRL's tool mask as turns.

Alignment: TRL's per-token log-probs are indexed by the generated token
(``per_token_logps[:, t]`` is log p(``completion_ids[:, t]``)), so process rewards
line up with ``completion_ids`` as they are; :func:`shaper.shaping.shift_token_rewards`
(for full-sequence layouts) is not applied.

A verdict that does not come in time, or a group the workers reject, is reported
(``prm/timeout`` and ``prm/accepted`` metrics, a warning) and the samples keep their
outcome without process rewards; ``on_timeout="raise"`` stops training instead.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from os import PathLike
from typing import Any, Literal

import numpy as np
import torch
from trl import GRPOTrainer

from infra.config import PipelineConfig, load_config
from shaper.reward_client import ProcessReduction, RewardClient, Sample, SampleReward, reduce_process
from shaper.shaping import shape_advantages

log = logging.getLogger(__name__)

__all__ = ["PRMGRPOTrainer", "PRMRewardFunction", "VerdictTimeout", "groups_of"]

OnTimeout = Literal["outcome_only", "raise"]


class VerdictTimeout(TimeoutError):
    """A group's verdict did not arrive in time (raised with ``on_timeout="raise"``)."""


def _config(cfg: PipelineConfig | str | PathLike | None) -> PipelineConfig:
    return cfg if isinstance(cfg, PipelineConfig) else load_config(None if cfg is None else str(cfg))


def groups_of(n: int, group_size: int, keys: Sequence[Any]) -> list[range]:
    """The blocks of ``group_size`` consecutive rows that form TRL's groups, checked.

    TRL repeats each prompt ``num_generations`` times in a row; a block whose prompts
    differ means the rows of one group are not all here (per-device batch not a
    multiple of the group size, or a custom sampler) — an error, not a silent regroup.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if n % group_size:
        raise ValueError(f"{n} completions do not split into groups of {group_size}: make the per-device batch "
                         "a multiple of num_generations so every group is scored by one process")
    blocks = [range(i, i + group_size) for i in range(0, n, group_size)]
    for block in blocks:
        first = keys[block.start]
        if any(keys[i] != first for i in block):
            raise ValueError(f"rows {block.start}..{block.stop - 1} should be {group_size} completions of one prompt "
                             "but their prompts differ: TRL's RepeatSampler layout is required")
    return blocks


def _settle(rewards: list[SampleReward], on_timeout: OnTimeout, counts: Counter[str]) -> None:
    for r in rewards:
        counts[r.status] += 1
    late = next((r for r in rewards if r.status == "timeout"), None)
    if late is not None:
        if on_timeout == "raise":
            raise VerdictTimeout(late.reason)
        log.warning("prm: %s; those samples keep their outcome and get no process rewards", late.reason)
    for r in rewards:
        if r.status in ("rejected", "discarded"):
            log.info("prm: group %s %s (%s): no process rewards", r.group_id, r.status, r.reason)
            break


# --------------------------------------------------------------------------- the reward function
class PRMRewardFunction:
    """An async ``GRPOTrainer`` reward function: ``outcome + reduction(process rewards)`` per completion.

    Args:
        cfg: the pipeline config (a :class:`PipelineConfig` or a YAML path; ``None``:
            ``$PRM_CONFIG``).
        tokenizer: the policy's tokenizer (TRL's ``processing_class``): re-tokenizes the
            prompts (chat template with the generation prompt for conversational ones)
            and decodes turns for scorers that read text.
        group_size: TRL's ``num_generations``.
        outcome: optional reward function with TRL's signature (sync or async) whose
            values are the samples' outcome; without it the outcome is 0 and the
            returned value is the process reduction alone (add your own reward
            functions to TRL's list for the outcome).
        reduction: ``mean`` (default), ``sum`` or ``last`` of the generated tokens'
            process rewards.
        verdict_timeout_s: bound on the wait per group (default: the workers'
            ``group_timeout_s`` + 30 s).
        on_timeout: ``outcome_only`` (default: warn, count, keep the outcome) or ``raise``.
        chat_template_kwargs: passed to ``apply_chat_template`` for conversational prompts.
    """

    def __init__(self, cfg: PipelineConfig | str | PathLike | None = None, *, tokenizer: Any, group_size: int,
                 outcome: Callable[..., Any] | None = None, reduction: ProcessReduction = "mean",
                 verdict_timeout_s: float | None = None, on_timeout: OnTimeout = "outcome_only",
                 chat_template_kwargs: Mapping[str, Any] | None = None, name: str = "prm") -> None:
        if on_timeout not in ("outcome_only", "raise"):
            raise ValueError(f"on_timeout must be 'outcome_only' or 'raise', got {on_timeout!r}")
        if reduction not in ("mean", "sum", "last"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'last', got {reduction!r}")
        self.cfg = _config(cfg)
        self.tokenizer = tokenizer
        self.group_size = int(group_size)
        self.outcome = outcome
        self.reduction: ProcessReduction = reduction
        self.on_timeout: OnTimeout = on_timeout
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = name  # TRL names the reward column after it
        self.client = RewardClient(self.cfg, verdict_timeout_s=verdict_timeout_s, decode=self._decode)
        self.counts: Counter[str] = Counter()
        self.last: list[SampleReward] = []  # the latest call's results, in TRL's row order

    def _decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def prompt_ids(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """The prompt as token ids, as TRL renders it for generation."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = self.tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                 **self.chat_template_kwargs)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    async def _outcomes(self, n: int, **kwargs: Any) -> list[float]:
        if self.outcome is None:
            return [0.0] * n
        values = self.outcome(**kwargs)
        if inspect.isawaitable(values):
            values = await values
        values = list(values)
        if len(values) != n:
            raise ValueError(f"the outcome function returned {len(values)} values for {n} completions")
        return [0.0 if v is None else float(v) for v in values]

    async def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                       trainer_state: Any = None, log_metric: Callable[[str, float], None] | None = None,
                       **columns: Any) -> list[float]:
        n = len(completion_ids)
        keys = [repr(p) for p in prompts]
        blocks = groups_of(n, self.group_size, keys)
        outcomes = await self._outcomes(n, prompts=prompts, completions=completions, completion_ids=completion_ids,
                                        trainer_state=trainer_state, log_metric=log_metric, **columns)
        step = getattr(trainer_state, "global_step", None)
        samples = []
        for prompt, completion, outcome in zip(prompts, completion_ids, outcomes):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            samples.append(Sample(prompt_ids=self.prompt_ids(prompt), response_ids=list(completion),
                                  outcome_reward=outcome, messages=messages, policy_version=step,
                                  truncated=bool(eos is not None and completion and completion[-1] != eos)))
        per_group = await asyncio.gather(*(
            self.client.score_group([samples[i] for i in block], group_id=f"trl-{uuid.uuid4().hex}")
            for block in blocks))
        rewards = [r for group in per_group for r in group]
        _settle(rewards, self.on_timeout, self.counts)
        self.last = rewards
        if log_metric is not None:
            log_metric("prm/accepted", sum(r.accepted for r in rewards) / n)
            log_metric("prm/timeout", sum(r.status == "timeout" for r in rewards) / n)
        return [r.outcome + reduce_process(r, self.reduction) for r in rewards]

    async def aclose(self) -> None:
        """Stop the Kafka clients (TRL never calls this; call it on TRL's loop when done)."""
        await self.client.aclose()


# --------------------------------------------------------------------------- the trainer subclass
class _LoopThread:
    """An event loop on a daemon thread: the Kafka clients live there, TRL's code stays synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="prm-reward-client", daemon=True)
        self.thread.start()
        ready.wait()

    def run(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()


class PRMGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages are ``(B, T)``: TRL's outcome advantages shaped by process rewards.

    Everything else is TRL's: generation, your ``reward_funcs`` (their weighted sum is
    the outcome, group-normalised by TRL), the loss. After TRL computes the ``(B,)``
    outcome advantages, each row's process rewards (from the pipeline, on the exact ids
    TRL generated) are folded in per token with :func:`shape_advantages` on
    ``completion_mask`` (times TRL's tool mask), as our shaping modes define; process
    rewards are never group-normalised.

    Extra keyword arguments:
        prm_config: the pipeline config or a YAML path (default ``$PRM_CONFIG``).
        shaping: ``mode`` and gvpo coefficients; default the config's
            ``rollout.agent.prm.advantage_shaping``.
        verdict_timeout_s, on_timeout: as :class:`PRMRewardFunction`.
    """

    def __init__(self, *args: Any, prm_config: PipelineConfig | str | PathLike | None = None,
                 shaping: Mapping[str, Any] | None = None, verdict_timeout_s: float | None = None,
                 on_timeout: OnTimeout = "outcome_only", **kwargs: Any) -> None:
        if on_timeout not in ("outcome_only", "raise"):
            raise ValueError(f"on_timeout must be 'outcome_only' or 'raise', got {on_timeout!r}")
        self.prm_config = _config(prm_config)
        configured = self.prm_config.prm.advantage_shaping
        options = {"mode": configured.mode, "negative_scale": configured.negative_scale,
                   "zero_penalty": configured.zero_penalty, "zero_eps": configured.zero_eps}
        unknown = set(shaping or {}) - set(options)
        if unknown:
            raise ValueError(f"shaping: unknown keys {sorted(unknown)}; known: {sorted(options)}")
        options.update(shaping or {})
        self.prm_shaping = options
        self.prm_on_timeout: OnTimeout = on_timeout
        self.prm_counts: Counter[str] = Counter()
        self.prm_last: list[SampleReward] = []
        self._prm_loop: _LoopThread | None = None
        self._prm_client: RewardClient | None = None
        self._prm_verdict_timeout_s = verdict_timeout_s
        self._prm_generated: tuple[Any, ...] | None = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ plumbing
    def _prm(self) -> tuple[_LoopThread, RewardClient]:
        if self._prm_loop is None:
            self._prm_loop = _LoopThread()
        if self._prm_client is None:
            tok = self._tokenizer
            self._prm_client = RewardClient(self.prm_config, verdict_timeout_s=self._prm_verdict_timeout_s,
                                            decode=lambda ids: tok.decode([int(i) for i in ids]))
        return self._prm_loop, self._prm_client

    def close_prm(self) -> None:
        """Stop the pipeline clients (``train()`` does it on return; scoring restarts them)."""
        if self._prm_client is not None and self._prm_loop is not None:
            self._prm_loop.run(self._prm_client.aclose())
        self._prm_client = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_prm()

    # ------------------------------------------------------------------ TRL hooks
    def _generate(self, prompts: list) -> Any:
        out = super()._generate(prompts)
        prompt_ids, completion_ids, tool_mask, _completions, logprobs = out[:5]
        self._prm_generated = (prompt_ids, completion_ids, tool_mask, logprobs)
        return out

    def _calculate_rewards(self, inputs: list, prompts: list, completions: list, completion_ids_list: list) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        n = len(prompts)
        local = rewards_per_func[self.accelerator.process_index * n:(self.accelerator.process_index + 1) * n]
        weighted = local * self.reward_weights.to(local.device).unsqueeze(0)
        outcomes = torch.where(torch.isnan(local).all(dim=1), torch.zeros(n, device=local.device),
                               weighted.nansum(dim=1)).tolist()
        self.prm_last = self._score(prompts, outcomes)
        return rewards_per_func

    def _score(self, prompts: list, outcomes: list[float]) -> list[SampleReward]:
        assert self._prm_generated is not None, "_generate did not run before the rewards"
        prompt_ids, completion_ids, tool_mask, logprobs = self._prm_generated
        training = self.model.training
        group_size = self.num_generations if training else self.num_generations_eval
        blocks = groups_of(len(completion_ids), group_size, [tuple(p) for p in prompt_ids])
        eos = set(self.eos_token_ids) | {self._tokenizer.pad_token_id}
        samples = []
        for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
            lp = None if logprobs is None else [float("nan") if x is None else float(x) for x in logprobs[i]]
            if lp is not None and len(lp) != len(completion):
                lp = None  # a backend that returns log-probs for some tokens only: send none rather than misalign
            messages = [{"role": "user", "content": prompts[i]}] if isinstance(prompts[i], str) else list(prompts[i])
            samples.append(Sample(
                prompt_ids=list(prompt), response_ids=list(completion), response_logprobs=lp,
                response_mask=None if tool_mask is None else list(tool_mask[i]), outcome_reward=outcomes[i],
                messages=messages, policy_version=self.state.global_step, is_eval=not training,
                truncated=bool(completion) and completion[-1] not in eos))
        loop, client = self._prm()

        async def score_all() -> list[list[SampleReward]]:
            return await asyncio.gather(*(
                client.score_group([samples[i] for i in block], group_id=f"trl-{uuid.uuid4().hex}")
                for block in blocks))

        rewards = [r for group in loop.run(score_all()) for r in group]
        _settle(rewards, self.prm_on_timeout, self.prm_counts)
        return rewards

    def _generate_and_score_completions(self, inputs: list) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        output["advantages"] = self.token_advantages(output, self.prm_last)
        mode = "train" if self.model.training else "eval"
        stats = torch.tensor([sum(r.accepted for r in self.prm_last), sum(r.status == "timeout" for r in self.prm_last),
                              len(self.prm_last)], dtype=torch.float32, device=self.accelerator.device)
        accepted, late, total = self.accelerator.gather(stats).view(-1, 3).sum(dim=0).tolist()
        self._metrics[mode]["prm/accepted"].append(accepted / max(total, 1.0))
        self._metrics[mode]["prm/timeout"].append(late / max(total, 1.0))
        return output

    def token_advantages(self, output: Mapping[str, Any], rewards: Sequence[SampleReward]) -> torch.Tensor:
        """``(B, T)`` advantages: the ``(B,)`` outcome advantages shaped by each row's process rewards."""
        advantages = output["advantages"]
        completion_ids = output["completion_ids"]
        b, t = completion_ids.shape
        if len(rewards) != b:
            raise RuntimeError(f"{len(rewards)} process-reward rows for a batch of {b}")
        process = torch.zeros(b, t, dtype=torch.float32)
        for i, r in enumerate(rewards):
            n = min(len(r.token_rewards), t)
            process[i, :n] = torch.from_numpy(r.token_rewards[:n])
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        device = advantages.device
        wide = advantages.unsqueeze(1).expand(b, t)
        return shape_advantages(wide, process.to(device), mask.to(device), **self.prm_shaping)
