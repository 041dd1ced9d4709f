"""verl 0.9.1 (docs/integrations/verl.md; the only module importing ``verl``): the reward manager ``prm_pipeline``
returns verl's outcome as a float naming the sample's member of its verdict (:mod:`shaper.reward_tags`); the estimator
``prm_grpo`` restores outcomes and process rewards from the verdicts in the driver, runs verl's GRPO and folds them in
(unshifted)."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.trainer.ppo import core_algos

from infra.config import ConfigError, PRMAdvantageShapingConfig, load_config
from shaper.integrations import core
from shaper.integrations.core import AdapterSettings, VerdictTimeout, close_verdict_lookups
from shaper.reward_client import BlockingVerdicts, Sample
from shaper.reward_tags import MAX_MEMBERS, member_tag, recover_rewards, tag_reward
from shaper.shaping import apply_shaping

log = logging.getLogger(__name__)
MANAGER_NAME, ESTIMATOR_NAME = "prm_pipeline", "prm_grpo"
SUPPORTS = ("outcome_only", "raise")
__all__ = ["ESTIMATOR_NAME", "MANAGER_NAME", "PRMRewardManager", "VerdictTimeout", "close_verdict_lookups"]
__all__ += ["compute_prm_grpo_advantage", "recover_rewards", "shaping_config", "shaping_options"]


@register(MANAGER_NAME)
class PRMRewardManager(NaiveRewardManager):
    """verl Reward Loop manager scoring every sample through the pipeline; ``reward.reward_kwargs``: ``prm_config``,
    ``group_size`` (default ``rollout.n``), ``verdict_timeout_s``, ``on_timeout`` (``outcome_only`` or ``raise``)."""

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        compute_score: Any,
        reward_router_address: Any = None,
        reward_model_tokenizer: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        opts = {**dict(core.option(config, "reward.reward_kwargs", {}) or {}), **options}
        self.pipeline = load_config(opts.get("prm_config"))
        self.group_size = int(opts.get("group_size") or core.option(config, "actor_rollout_ref.rollout.n", 1))
        on_timeout, timeout_s = str(opts.get("on_timeout", "outcome_only")), opts.get("verdict_timeout_s")
        self.settings = AdapterSettings.checked(
            on_timeout=on_timeout, verdict_timeout_s=timeout_s, supports=SUPPORTS, key="reward_kwargs.on_timeout"
        )
        self.response_length = core.option(config, "actor_rollout_ref.rollout.response_length")
        _check_route(config, self.group_size)
        self.counts: Counter[str] = Counter()
        self.client = self.settings.client(self.pipeline, lambda ids: self.tokenizer.decode(ids))

    async def aclose(self) -> None:
        """Stop the Kafka clients (verl never calls this; tests and scripts do)."""
        await self.client.aclose()

    def sample(self, item: Any, outcome: float, *, is_eval: bool) -> Sample:
        """A row's valid prompt and response tokens; ``response_mask`` (colocated path) splits turns."""
        batch, keys = item.batch, set(item.batch.keys())
        prompt_len = batch["prompts"].shape[-1]
        attention = batch["attention_mask"].cpu().numpy().astype(bool)
        valid_len = int(attention[prompt_len:].sum())
        raw_prompt = item.non_tensor_batch.get("raw_prompt")
        response = {k: batch[k].cpu().numpy()[:valid_len] for k in ("rollout_log_probs", "response_mask") if k in keys}
        return Sample(
            prompt_ids=batch["prompts"].cpu().numpy()[attention[:prompt_len]],
            response_ids=batch["responses"].cpu().numpy()[:valid_len],
            response_logprobs=response.get("rollout_log_probs"),
            response_mask=response.get("response_mask"),
            outcome_reward=outcome,
            messages=[dict(m) for m in raw_prompt] if raw_prompt is not None else (),
            truncated=valid_len >= int(self.response_length or batch["responses"].shape[-1]),
            is_eval=is_eval,
        )

    async def run_single(self, data: DataProto) -> dict:
        result = await super().run_single(data)  # verl's outcome score, exactly as its naive manager
        outcome = float(result["reward_score"])
        if not math.isfinite(outcome):
            raise core.ShapingInputError(f"prm_pipeline: compute_score returned {outcome!r}; outcomes must be finite")
        item = data[-1:][0]  # multi-sequence outputs: the last sequence, like verl's managers
        if "uid" not in item.non_tensor_batch:
            raise KeyError("prm_pipeline needs the group id in non_tensor_batch['uid'] (verl sets it for GRPO)")
        t0 = time.monotonic()
        sample = self.sample(item, outcome, is_eval=bool(data.meta_info.get("validate", False)))
        group_id = str(item.non_tensor_batch["uid"])
        reward = await self.client.score(sample, group_id=group_id, group_size=self.group_size)
        core.settle([reward], self.settings, self.counts, who=MANAGER_NAME)
        tag = member_tag(reward.verdict, reward.trajectory_id)
        info = {
            **result.get("reward_extra_info", {}),
            "prm_status": reward.status,
            "prm_reason": reward.reason,
            "prm_process_reward": reward.process_total(),
            "prm_verdict_wait_s": time.monotonic() - t0,
            "prm_outcome": outcome,
            "prm_member": tag,
        }
        return {"reward_score": tag_reward(outcome, tag), "reward_extra_info": info}


def _check_route(config: Any, group_size: int) -> None:
    """Refuse, at start-up, settings under which the member tags could not reach ``prm_grpo`` intact."""
    if group_size > MAX_MEMBERS:
        raise ConfigError(
            f"prm_pipeline: groups of {group_size} exceed the {MAX_MEMBERS} members a reward tag can name"
        )
    estimator, algorithm = str(core.option(config, "algorithm.adv_estimator", "")), core.option(config, "algorithm")
    if core.option(algorithm, "use_kl_in_reward", False) and estimator == ESTIMATOR_NAME:
        raise ConfigError(
            "prm_pipeline: algorithm.use_kl_in_reward=true adds a KL penalty to the rewards that carry "
            "the member tags; use actor_rollout_ref.actor.use_kl_loss=true with prm_grpo"
        )
    filtered_on = (
        core.option(algorithm, "filter_groups.metric") if core.option(algorithm, "filter_groups.enable") else None
    )
    if filtered_on == "reward":
        raise ConfigError(
            "prm_pipeline: algorithm.filter_groups.metric=reward reads rm_scores, whose values carry "
            "member tags; use algorithm.filter_groups.metric=prm_outcome (the exact outcome)"
        )
    if estimator and estimator != ESTIMATOR_NAME:
        why = "verdicts are awaited and reported, but process rewards are not trained on"
        log.warning("prm_pipeline: algorithm.adv_estimator=%s, not %s: %s", estimator, ESTIMATOR_NAME, why)


_seen_tagged = False


def _verdicts(config: Any) -> BlockingVerdicts:
    """The driver's verdict lookup for ``algorithm.prm_config`` (one per config and lookback, started on first use)."""
    return core.verdict_lookup(core.option(config, "prm_config"), core.option(config, "prm_verdict_lookback_s", 3600.0))


def shaping_config(config: Any) -> PRMAdvantageShapingConfig:
    """The YAML's shaping (``algorithm.prm_config`` or ``$PRM_CONFIG``) with ``algorithm.prm_shaping`` overrides."""
    overrides = core.option(config, "prm_shaping", {}) or {}
    pairs = tuple(sorted((str(k), overrides[k]) for k in overrides))
    return core.shaping_for(core.option(config, "prm_config"), pairs, "algorithm.prm_shaping")


def shaping_options(config: Any) -> dict[str, Any]:
    """:func:`shaping_config` as a plain mapping (mode and every coefficient)."""
    return msgspec.structs.asdict(shaping_config(config))


@core_algos.register_adv_est(ESTIMATOR_NAME)
def compute_prm_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    epsilon: float = 1e-6,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO on the exact outcomes, then the process rewards folded in (options: docs/integrations/verl.md)."""
    global _seen_tagged
    if index is None:
        raise core.ShapingInputError("prm_grpo needs the group index: non_tensor_batch['uid'] must be set")
    if core.option(config, "use_kl_in_reward", False):
        raise ConfigError(
            "prm_grpo needs algorithm.use_kl_in_reward=false: a KL penalty folded into the token "
            "rewards would corrupt the member tags (use actor.use_kl_loss instead)"
        )
    wait_s = float(core.option(config, "prm_verdict_wait_s", 60.0))
    outcome, process, tagged = recover_rewards(
        token_level_rewards, response_mask, index, _verdicts(config), wait_s=wait_s
    )
    why = (
        f"prm_grpo: none of the {len(index)} samples of this batch names a member of a verdict: every verdict "
        "timed out, or the reward manager is not prm_pipeline (PRMRewardManager)"
    )
    if not tagged and not _seen_tagged:
        raise core.VerdictMismatch(why + "; refusing to train plain GRPO from the first batch on")
    if not tagged:
        log.warning("%s; this batch trains on outcomes only", why)
    _seen_tagged = _seen_tagged or tagged > 0
    advantages, _returns = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=outcome,
        response_mask=response_mask,
        index=index,
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=bool(core.option(config, "norm_adv_by_std_in_grpo", True)),
        config=config,
    )
    shaped = apply_shaping(advantages, process.to(advantages.device), response_mask, shaping_config(config))
    return shaped, shaped
