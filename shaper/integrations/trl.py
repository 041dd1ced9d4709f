"""TRL (tested against 1.16.0; docs/integrations/trl.md): a ``GRPOTrainer`` reward function and a trainer subclass.

A block of ``group_size`` completions is one group. TRL's log-probs are indexed by the generated
token, so process rewards line up with ``completion_ids`` unshifted. The only module that imports ``trl``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import torch
from trl import GRPOTrainer

from shaper.integrations import core
from shaper.integrations.core import AdapterSettings, OnTimeout, VerdictTimeout, groups_of
from shaper.reward_client import ProcessReduction, Sample, SampleReward

__all__ = ["PRMGRPOTrainer", "PRMRewardFunction", "VerdictTimeout", "groups_of"]
SUPPORTS = ("outcome_only", "raise")


def _sample(
    prompt: Any, prompt_ids: Any, completion: Sequence[int], outcome: Any, step: int | None, eos: set[int], **extra: Any
) -> Sample:
    return Sample(
        prompt_ids=list(prompt_ids),
        response_ids=list(completion),
        outcome_reward=float(outcome or 0.0),
        messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt),
        policy_version=step,
        truncated=bool(eos and completion) and completion[-1] not in eos,
        **extra,
    )


class PRMRewardFunction:
    """Async reward function: ``outcome + reduction(process rewards)`` per completion; ``outcome``
    is an optional reward function with TRL's signature (sync or async; default 0)."""

    def __init__(
        self,
        cfg: core.ConfigArg = None,
        *,
        tokenizer: Any,
        group_size: int,
        outcome: Callable[..., Any] | None = None,
        reduction: ProcessReduction = "mean",
        verdict_timeout_s: float | None = None,
        on_timeout: OnTimeout = "outcome_only",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        name: str = "prm",
    ) -> None:
        self.settings = AdapterSettings.checked(
            on_timeout=on_timeout, reduction=reduction, verdict_timeout_s=verdict_timeout_s, supports=SUPPORTS
        )
        self.cfg, self.tokenizer, self.outcome = core.load_pipeline(cfg), tokenizer, outcome
        self.group_size = group_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = name  # TRL names the reward column after it
        self.client = self.settings.client(self.cfg, lambda ids: tokenizer.decode([int(i) for i in ids]))
        self.counts: Counter[str] = Counter()
        self.last: list[SampleReward] = []  # the latest call's results, in TRL's row order

    def prompt_ids(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """The prompt as token ids, as TRL renders it for generation."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = self.tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, **self.chat_template_kwargs
        )
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    async def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        trainer_state: Any = None,
        log_metric: Callable[[str, float], None] | None = None,
        **columns: Any,
    ) -> list[float]:
        columns.update(completions=completions, trainer_state=trainer_state, log_metric=log_metric)
        outcomes = await core.outcomes_of(self.outcome, prompts, completion_ids, columns)
        eos_id: int | None = getattr(self.tokenizer, "eos_token_id", None)
        eos = set() if eos_id is None else {eos_id}
        step = getattr(trainer_state, "global_step", None)
        samples = [
            _sample(p, self.prompt_ids(p), c, o, step, eos) for p, c, o in zip(prompts, completion_ids, outcomes)
        ]
        keys, size = [repr(p) for p in prompts], int(self.group_size)
        self.last = await core.score_blocks(self.client, samples, keys, size, self.settings, self.counts, prefix="trl")
        if log_metric is not None:
            for name, value in core.status_rates(self.last).items():
                log_metric(name, value)
        return [self.settings.scalar(r) for r in self.last]

    async def aclose(self) -> None:
        """Stop the Kafka clients (TRL never calls this; call it on TRL's loop when done)."""
        await self.client.aclose()


class PRMGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with ``(B, T)`` advantages: TRL's outcome advantages shaped by process rewards;
    ``shaping`` overrides the config's ``advantage_shaping`` (``mode``, coefficients)."""

    def __init__(
        self,
        *args: Any,
        prm_config: core.ConfigArg = None,
        shaping: Mapping[str, Any] | None = None,
        verdict_timeout_s: float | None = None,
        on_timeout: OnTimeout = "outcome_only",
        **kwargs: Any,
    ) -> None:
        self.prm_settings = AdapterSettings.checked(
            on_timeout=on_timeout, verdict_timeout_s=verdict_timeout_s, supports=SUPPORTS
        )
        self.prm_config = cfg = core.load_pipeline(prm_config)
        self.prm_shaping = msgspec.structs.asdict(core.shaping_with(cfg.prm.advantage_shaping, shaping, "shaping"))
        self.prm_counts: Counter[str] = Counter()
        self.prm_last: list[SampleReward] = []
        self._prm = core.LoopClient(
            lambda: core.resolved(
                self.prm_settings.client(cfg, lambda ids: self._tokenizer.decode([int(i) for i in ids]))
            ),
            "prm-reward-client",
        )
        super().__init__(*args, **kwargs)

    def close_prm(self) -> None:
        """Stop the pipeline clients (``train()`` does it on return; scoring restarts them)."""
        self._prm.close(timeout=None)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_prm()

    def _generate(self, prompts: list) -> Any:
        out = super()._generate(prompts)
        self._prm_generated = (out[0], out[1], out[2], out[4])  # prompt ids, completion ids, tool mask, log-probs
        return out

    def _calculate_rewards(self, inputs: list, prompts: list, completions: list, completion_ids_list: list) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        n, rank = len(prompts), self.accelerator.process_index
        local = rewards_per_func[rank * n : (rank + 1) * n]
        weighted = (local * self.reward_weights.to(local.device).unsqueeze(0)).nansum(dim=1)
        outcomes = torch.where(torch.isnan(local).all(dim=1), torch.zeros_like(weighted), weighted).tolist()
        prompt_ids, completion_ids, tool_mask, logprobs = self._prm_generated
        eos, training = set(self.eos_token_ids) | {self._tokenizer.pad_token_id}, self.model.training
        step = self.state.global_step
        samples = []
        for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
            lp = None if logprobs is None else [float("nan") if x is None else float(x) for x in logprobs[i]]
            extra = {  # log-probs for some tokens only: send none rather than misalign
                "response_logprobs": lp if lp is not None and len(lp) == len(completion) else None,
                "response_mask": None if tool_mask is None else list(tool_mask[i]),
            }
            samples.append(
                _sample(prompts[i], prompt, completion, outcomes[i], step, eos, is_eval=not training, **extra)
            )
        size = self.num_generations if training else self.num_generations_eval
        self.prm_last = self._prm.run(
            lambda client: core.score_blocks(
                client, samples, [tuple(p) for p in prompt_ids], size, self.prm_settings, self.prm_counts, prefix="trl"
            )
        )
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        mask = output["completion_mask"] * output["tool_mask"] if "tool_mask" in output else output["completion_mask"]
        output["advantages"] = core.shape_rows(output["advantages"], self.prm_last, mask, self.prm_shaping)
        stats = torch.tensor(core.status_counts(self.prm_last), dtype=torch.float32, device=self.accelerator.device)
        accepted, late, total = self.accelerator.gather(stats).view(-1, 3).sum(dim=0).tolist()
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["prm/accepted"].append(accepted / max(total, 1.0))
        metrics["prm/timeout"].append(late / max(total, 1.0))
        return output
