"""verl integration: a Reward Loop manager that scores through the pipeline, and ``prm_grpo``.

The only module of the project that imports ``verl`` (tested against verl 0.9.1; see
docs/integrations/verl.md). It is a thin layer over :mod:`shaper.reward_client`.
Importing it registers two names with verl:

* reward manager ``prm_pipeline`` (:class:`PRMRewardManager`, verl's Reward Loop
  ``register(name)`` / ``async run_single(data)``). For every sample verl hands over it
  computes verl's own outcome score (it *is* verl's ``naive`` manager for that part),
  scores the sample through :class:`~shaper.reward_client.RewardClient` (group = verl's
  ``uid``, group size = ``rollout.n``) and returns the outcome as a float that names the
  sample's member of its group's verdict (:mod:`shaper.reward_tags`). A verdict that
  does not come in time is reported (``prm_status=timeout``, a warning, a counter),
  never turned into a zero.
* advantage estimator ``prm_grpo`` (:func:`compute_prm_grpo_advantage`): in the
  driver, fetches the batch's verdicts by ``uid``, reads each row's member tag from its
  reward, restores the exact outcome and lays the member's process token rewards on the
  row; then verl's GRPO on the outcome and :func:`shaper.shaping.apply_shaping` with the
  configured mode (any mode of :mod:`infra.modes`).

Why this route (docs/integrations/verl.md has the figures and the alternatives): on
verl's default path the reward is computed inside the agent loop and only a float per
sample survives (``AgentLoopOutput.reward_score`` -> ``rm_scores`` at the last valid
token), and a registered estimator receives only ``token_level_rewards``,
``response_mask``, the ``uid`` index and the algorithm config. The float is the one
channel both ends share, on the agent-loop and the colocated reward-model path alike,
so it carries the key and the verdicts topic carries the rewards. verl's response
tensors are indexed by the generated token, so :func:`shaper.shaping.shift_token_rewards`
is the identity here and is not applied.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import msgspec
import numpy as np
import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.trainer.ppo import core_algos

from infra.config import PipelineConfig, PRMAdvantageShapingConfig, load_config
from infra.schema import GroupVerdict
from shaper.reward_client import BlockingVerdicts, RewardClient, Sample, session_turn_rewards, turn_spans
from shaper.reward_tags import MAX_MEMBERS, member_by_tag, member_tag, read_tag, tag_reward, tagged_matches
from shaper.shaping import apply_shaping

log = logging.getLogger(__name__)

MANAGER_NAME = "prm_pipeline"
ESTIMATOR_NAME = "prm_grpo"

__all__ = [
    "ESTIMATOR_NAME", "MANAGER_NAME", "PRMRewardManager", "VerdictTimeout", "close_verdict_lookups",
    "compute_prm_grpo_advantage", "recover_rewards", "shaping_config", "shaping_options",
]


class VerdictTimeout(TimeoutError):
    """A group's verdict did not arrive within ``verdict_timeout_s`` (raised with ``on_timeout: raise``)."""


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b`` for verl's DictConfig / dataclass configs and plain dicts alike."""
    node = config
    for key in dotted.split("."):
        if node is None:
            return default
        node = node.get(key) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, key, None)
    return default if node is None else node


# --------------------------------------------------------------------------- the reward manager
@register(MANAGER_NAME)
class PRMRewardManager(NaiveRewardManager):
    """verl Reward Loop manager scoring every sample through the pipeline.

    Options come from ``reward.reward_kwargs`` (as verl's DAPO manager reads its own):
    ``prm_config`` (our YAML; default ``$PRM_CONFIG``), ``group_size`` (default
    ``actor_rollout_ref.rollout.n``), ``verdict_timeout_s`` (default the workers'
    ``group_timeout_s`` + 30 s: a group missing members is rejected by the workers
    before we give up), ``on_timeout`` (``outcome_only`` — the default: the sample keeps
    verl's outcome, no process rewards, ``prm_status=timeout`` — or ``raise``).

    Settings under which process rewards could not reach ``prm_grpo`` are refused here,
    when verl builds the manager: a KL penalty in the reward, DAPO filtering on the raw
    reward tensor, groups larger than a member tag can name.
    """

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any, reward_router_address: Any = None,
                 reward_model_tokenizer: Any = None, **options: Any) -> None:
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        opts = {**dict(_get(config, "reward.reward_kwargs", {}) or {}), **options}
        self.pipeline: PipelineConfig = load_config(opts.get("prm_config"))
        self.group_size = int(opts.get("group_size") or _get(config, "actor_rollout_ref.rollout.n", 1))
        self.verdict_timeout_s = float(opts.get("verdict_timeout_s", self.pipeline.worker.group_timeout_s + 30))
        self.on_timeout = str(opts.get("on_timeout", "outcome_only"))
        if self.on_timeout not in ("outcome_only", "raise"):
            raise ValueError(f"reward_kwargs.on_timeout must be 'outcome_only' or 'raise', got {self.on_timeout!r}")
        self.response_length = _get(config, "actor_rollout_ref.rollout.response_length")
        _check_route(config, self.group_size)
        self.counts: Counter[str] = Counter()
        self.client = RewardClient(self.pipeline, verdict_timeout_s=self.verdict_timeout_s,
                                   decode=lambda ids: self.tokenizer.decode(ids))

    async def aclose(self) -> None:
        """Stop the Kafka clients (verl never calls this; tests and scripts do)."""
        await self.client.aclose()

    def sample(self, item: Any, outcome: float, *, is_eval: bool) -> Sample:
        """One row of verl's batch as a :class:`Sample`: the valid prompt and response tokens.

        ``response_mask`` (colocated path) splits the response into turns; verl's agent
        loop does not hand it to reward managers, so there the response is one turn.
        """
        batch = item.batch
        prompt_len = batch["prompts"].shape[-1]
        attention = batch["attention_mask"].cpu().numpy().astype(bool)
        valid_len = int(attention[prompt_len:].sum())
        keys = set(batch.keys())
        raw_prompt = item.non_tensor_batch.get("raw_prompt")
        limit = int(self.response_length or batch["responses"].shape[-1])
        return Sample(
            prompt_ids=batch["prompts"].cpu().numpy()[attention[:prompt_len]],
            response_ids=batch["responses"].cpu().numpy()[:valid_len],
            response_logprobs=batch["rollout_log_probs"].cpu().numpy()[:valid_len]
            if "rollout_log_probs" in keys else None,
            response_mask=batch["response_mask"].cpu().numpy()[:valid_len] if "response_mask" in keys else None,
            outcome_reward=outcome, messages=[dict(m) for m in raw_prompt] if raw_prompt is not None else (),
            truncated=valid_len >= limit, is_eval=is_eval,
        )

    async def run_single(self, data: DataProto) -> dict:
        result = await super().run_single(data)  # verl's outcome score, exactly as its naive manager
        outcome = float(result["reward_score"])
        if not math.isfinite(outcome):
            raise ValueError(f"prm_pipeline: compute_score returned {outcome!r}; outcomes must be finite")
        item = data[-1:][0]  # multi-sequence outputs: the last sequence, like verl's managers
        if "uid" not in item.non_tensor_batch:
            raise KeyError("prm_pipeline needs the sample's group id in non_tensor_batch['uid'] (verl sets it for GRPO)")
        uid = str(item.non_tensor_batch["uid"])
        sample = self.sample(item, outcome, is_eval=bool(data.meta_info.get("validate", False)))
        t0 = time.monotonic()
        reward = await self.client.score(sample, group_id=uid, group_size=self.group_size)
        waited = time.monotonic() - t0
        if reward.status == "timeout":
            log.warning("prm_pipeline: %s; the sample keeps its outcome score and gets no process rewards",
                        reward.reason)
            if self.on_timeout == "raise":
                raise VerdictTimeout(reward.reason)
        elif not reward.accepted:
            log.info("prm_pipeline: group %s %s (%s): no process rewards", uid, reward.status, reward.reason)
        tag = member_tag(reward.verdict, reward.trajectory_id)
        self.counts[reward.status] += 1
        info = dict(result.get("reward_extra_info", {}))
        info.update(prm_status=reward.status, prm_reason=reward.reason, prm_process_reward=reward.process_total(),
                    prm_verdict_wait_s=waited, prm_outcome=outcome, prm_member=tag)
        return {"reward_score": tag_reward(outcome, tag), "reward_extra_info": info}


def _check_route(config: Any, group_size: int) -> None:
    """Refuse, at start-up, settings under which the member tags could not reach ``prm_grpo`` intact."""
    if group_size > MAX_MEMBERS:
        raise ValueError(f"prm_pipeline: groups of {group_size} exceed the {MAX_MEMBERS} members a reward tag can name")
    algorithm = _get(config, "algorithm")
    if algorithm is None:
        return
    estimator = str(_get(algorithm, "adv_estimator", ""))
    if _get(algorithm, "use_kl_in_reward", False) and estimator == ESTIMATOR_NAME:
        raise ValueError("prm_pipeline: algorithm.use_kl_in_reward=true adds a KL penalty to the rewards that carry "
                         "the member tags; use actor_rollout_ref.actor.use_kl_loss=true with prm_grpo")
    if _get(algorithm, "filter_groups.enable", False) and str(_get(algorithm, "filter_groups.metric", "")) == "reward":
        raise ValueError("prm_pipeline: algorithm.filter_groups.metric=reward reads rm_scores, whose values carry "
                         "member tags; use algorithm.filter_groups.metric=prm_outcome (the exact outcome)")
    if estimator and estimator != ESTIMATOR_NAME:
        log.warning("prm_pipeline: algorithm.adv_estimator=%s, not %s: verdicts are awaited and reported, but "
                    "process rewards are not trained on", estimator, ESTIMATOR_NAME)


# --------------------------------------------------------------------------- the advantage estimator
_LOOKUPS: dict[tuple[str | None, float], BlockingVerdicts] = {}
_route_logged = False
_seen_tagged = False


def _verdicts(config: Any) -> BlockingVerdicts:
    """The driver's verdict lookup for ``algorithm.prm_config`` (one per config, started on first use)."""
    key = (_get(config, "prm_config"), float(_get(config, "prm_verdict_lookback_s", 3600.0)))
    if key not in _LOOKUPS:
        _LOOKUPS[key] = BlockingVerdicts(load_config(key[0]), lookback_s=key[1])
    return _LOOKUPS[key]


def close_verdict_lookups() -> None:
    """Stop the estimator's verdict consumers (tests and scripts; verl's driver just exits)."""
    while _LOOKUPS:
        _LOOKUPS.popitem()[1].close()


def recover_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                    verdicts: Any, *, wait_s: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(outcome rewards, process rewards, tagged rows)`` of a batch scored by :class:`PRMRewardManager`.

    Each row's reward sits at its last valid token (verl puts it there); a nonzero
    member tag in it names the row's member of the ``index`` group's verdict, fetched
    with ``verdicts.get(uids, wait_s)``. The outcome is restored exactly from the
    verdict, and for an accepted verdict the member's token rewards are laid on the
    response: one turn covering the valid response, or one span per run of
    ``response_mask`` ones. Untagged rows (no verdict came) keep their reward as it is.
    A tag that does not decode is an error naming the row and group.
    """
    rewards = token_level_rewards.detach().to("cpu", torch.float32)
    n, width = rewards.shape
    positions = torch.arange(width)
    last = torch.where(rewards != 0, positions, -1).amax(dim=-1).tolist()
    tags = [read_tag(float(rewards[i, p])) if p >= 0 else 0 for i, p in enumerate(last)]
    tagged = [i for i in range(n) if tags[i]]
    outcome = rewards.clone()
    process = torch.zeros_like(rewards)
    if not tagged:
        return outcome.to(token_level_rewards), process.to(token_level_rewards), 0
    uids = [str(index[i]) for i in range(n)]
    found: dict[str, GroupVerdict] = verdicts.get([uids[i] for i in tagged], wait_s)
    owner: dict[tuple[str, int], int] = {}
    mask = response_mask.detach().cpu().numpy()
    for i in tagged:
        uid, tag, pos = uids[i], tags[i], last[i]
        value = float(rewards[i, pos])
        if (uid, tag) in owner:
            raise RuntimeError(f"prm_grpo: rows {owner[uid, tag]} and {i} both carry member {tag} of group {uid!r} "
                               "(an agent loop returning several outputs per sample is not supported)")
        owner[uid, tag] = i
        verdict = found.get(uid)
        if verdict is None:
            raise RuntimeError(f"prm_grpo: row {i} carries member tag {tag} of group {uid!r}, but no verdict for that "
                               f"group arrived within {wait_s:g}s: is the reward manager prm_pipeline, on the same "
                               "pipeline config (algorithm.prm_config)?")
        session = member_by_tag(verdict, tag)
        if session is None or session.outcome_reward is None or not tagged_matches(value, session.outcome_reward):
            raise RuntimeError(f"prm_grpo: row {i}'s reward {value!r} does not decode as a member of group {uid!r} "
                               f"(tag {tag}, {len(verdict.sessions)} sessions in its verdict)")
        outcome[i, pos] = float(np.float32(session.outcome_reward))
        if verdict.status != "accepted":
            continue
        per_turn = session_turn_rewards(session, group_id=uid)
        if not per_turn:
            continue
        valid = pos + 1
        spans = [(0, valid)] if len(per_turn) == 1 and len(per_turn[0]) == valid else turn_spans(mask[i], valid)
        if [len(v) for v in per_turn] != [e - s for s, e in spans]:
            raise RuntimeError(f"prm_grpo: row {i} (group {uid!r}) has turns {spans} but its verdict scored turns of "
                               f"{[len(v) for v in per_turn]} tokens")
        for (start, end), values in zip(spans, per_turn):
            process[i, start:end] = torch.from_numpy(np.asarray(values, dtype=np.float32))
    return outcome.to(token_level_rewards), process.to(token_level_rewards), len(tagged)


@lru_cache(maxsize=8)
def _shaping_from_file(path: str | None) -> PRMAdvantageShapingConfig:
    return load_config(path).prm.advantage_shaping


@lru_cache(maxsize=32)
def _shaping(path: str | None, overrides: tuple[tuple[str, Any], ...]) -> PRMAdvantageShapingConfig:
    """The file's shaping with ``overrides``, checked once (as a loaded config is) per distinct setting."""
    base = _shaping_from_file(path)
    known = set(base.__struct_fields__)
    unknown = {k for k, _ in overrides} - known
    if unknown:
        raise ValueError(f"algorithm.prm_shaping: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        return msgspec.structs.replace(base, **dict(overrides))
    except ValueError as exc:  # ConfigError: unknown mode, bad coefficient
        raise ValueError(f"algorithm.prm_shaping: {exc}") from None


def shaping_config(config: Any) -> PRMAdvantageShapingConfig:
    """Shaping mode and coefficients: our YAML (``algorithm.prm_config`` or ``$PRM_CONFIG``), then
    ``algorithm.prm_shaping`` overrides; AReaL's defaults (``additive``) without either."""
    overrides = _get(config, "prm_shaping", {}) or {}
    return _shaping(_get(config, "prm_config"), tuple(sorted((str(k), overrides[k]) for k in overrides)))


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
    """verl's GRPO on the outcome, then the process rewards folded in by :func:`apply_shaping`.

    Process rewards come from the batch's verdicts (:func:`recover_rewards`; options
    ``algorithm.prm_config``, ``prm_verdict_wait_s`` (default 60), ``prm_verdict_lookback_s``
    (default 3600)). Without process rewards this equals verl's ``grpo`` on the exact
    outcomes. Process rewards are never group-normalised. Returns ``(advantages,
    returns)`` with returns = advantages, like verl's GRPO.
    """
    global _route_logged, _seen_tagged
    if index is None:
        raise ValueError("prm_grpo needs the group index: non_tensor_batch['uid'] must be set")
    if _get(config, "use_kl_in_reward", False):
        raise ValueError("prm_grpo needs algorithm.use_kl_in_reward=false: a KL penalty folded into the token "
                         "rewards would corrupt the member tags (use actor.use_kl_loss instead)")
    outcome, process, tagged = recover_rewards(token_level_rewards, response_mask, index, _verdicts(config),
                                               wait_s=float(_get(config, "prm_verdict_wait_s", 60.0)))
    n = token_level_rewards.shape[0]
    if not tagged:
        message = (f"prm_grpo: none of the {n} samples of this batch names a member of a verdict: every verdict "
                   "timed out, or the reward manager is not prm_pipeline (reward.reward_manager.name=PRMRewardManager)")
        if not _seen_tagged:
            raise RuntimeError(message + "; refusing to train plain GRPO from the first batch on")
        log.warning("%s; this batch trains on outcomes only", message)
    else:
        _seen_tagged = True
        if not _route_logged:
            _route_logged = True
            log.info("prm_grpo: process rewards reach the estimator through the verdicts of %d/%d samples "
                     "(reward tag + verdict lookup by uid)", tagged, n)
    advantages, _returns = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=outcome, response_mask=response_mask, index=index, epsilon=epsilon,
        norm_adv_by_std_in_grpo=bool(_get(config, "norm_adv_by_std_in_grpo", True)), config=config,
    )
    shaped = apply_shaping(advantages, process.to(advantages.device), response_mask, shaping_config(config))
    return shaped, shaped
