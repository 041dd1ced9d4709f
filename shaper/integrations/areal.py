"""AReaL (1.0.4; docs/integrations/areal.md; the only module importing ``areal``): a ``RolloutWorkflow`` wrapper.

:class:`PRMRolloutWorkflow` runs ``group_size`` episodes of an agent workflow for one data
item, as AReaL's ``GroupedRolloutWorkflow`` does, then turns every exported interaction
(``ArealOpenAI.export_interactions``; ``concat``: the leaves) into one sample (AReaL's own
``to_tensor_dict()`` ids, log-probs, loss mask), scores the group and writes the verdict
back: each chain member's ``token_rewards`` where AReaL has that field, else (1.0.4)
``reward`` = outcome + the reduced process rewards (``tensor_token_rewards=True``: also
``token_rewards`` ``[1, L]`` in the leaf's tensor dict, unshifted).

A group the workers reject (or discard) is rejected for AReaL too (``None``). A late
verdict rejects the group by default (``on_timeout="reject"``); ``outcome_only`` keeps the
workflow's rewards and ``raise`` stops the rollout (:mod:`shaper.integrations.core`'s policy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.types import InteractionWithTokenLogpReward

from shaper.integrations import core
from shaper.integrations.core import AdapterSettings, ConfigError, OnTimeout, ShapingInputError, VerdictTimeout
from shaper.reward_client import ProcessReduction, Sample, SampleReward

log = logging.getLogger(__name__)

__all__ = ["HAS_TOKEN_REWARDS_FIELD", "PRMRolloutWorkflow", "VerdictTimeout", "chain_of", "sample_of"]

HAS_TOKEN_REWARDS_FIELD = "token_rewards" in {f.name for f in dataclasses.fields(InteractionWithTokenLogpReward)}
"""Whether this AReaL's interactions carry per-token process rewards (1.0.4: no)."""


def chain_of(interaction: InteractionWithTokenLogpReward) -> list[InteractionWithTokenLogpReward]:
    """The interactions whose outputs make up ``interaction``'s training sequence, root first.

    In ``concat`` mode a child's sequence extends its parent's (AReaL's ``to_tensor_dict``
    keeps the parents' loss mask); otherwise the interaction stands alone.
    """
    chain = [interaction]
    if interaction.chat_template_type == "concat":
        while chain[-1].parent is not None:
            chain.append(chain[-1].parent)
    return chain[::-1]


def _tensor_dict(interaction: InteractionWithTokenLogpReward) -> dict[str, torch.Tensor]:
    """AReaL's own layout of the interaction, without leaving stale caches behind (it caches the reward)."""
    out = interaction.to_tensor_dict()
    for member in chain_of(interaction):
        member._cache = None
    return out


def sample_of(interaction: InteractionWithTokenLogpReward, *, policy_version: int | None = None) -> Sample:
    """One exported interaction as a :class:`Sample`: prompt = the tokens before the first trained one."""
    if interaction.model_response is None:
        raise ShapingInputError(
            f"interaction {interaction.interaction_id!r} has no model_response (token-backed "
            "interactions only: export from ArealOpenAI)"
        )
    td = _tensor_dict(interaction)
    ids = td["input_ids"][0].numpy()
    mask = td["loss_mask"][0].numpy().astype(bool)
    if not mask.any():
        raise ShapingInputError(f"interaction {interaction.interaction_id!r} has no generated tokens to score")
    start = int(np.argmax(mask))
    root = chain_of(interaction)[0]
    return Sample(
        prompt_ids=ids[:start],
        response_ids=ids[start:],
        response_logprobs=td["logprobs"][0].numpy()[start:],
        response_mask=mask[start:].astype(np.int8),
        outcome_reward=float(interaction.reward or 0.0),
        messages=list(root.messages or []),
        policy_version=policy_version,
        truncated=interaction.model_response.stop_reason == "length",
    )


class PRMRolloutWorkflow(RolloutWorkflow):
    """``GroupedRolloutWorkflow`` that scores the group through the pipeline before AReaL trains on it.

    ``workflow`` returns ``ArealOpenAI.export_interactions(...)``; ``group_size`` is AReaL's
    ``gconfig.n_samples``; ``on_timeout`` is ``reject`` (default), ``outcome_only`` or ``raise``;
    ``reduction`` makes the scalar added to ``reward`` where there is no ``token_rewards`` field;
    ``decode`` (ids -> text) serves scorers that read words; ``version()`` (``engine.get_version``) is per group.
    """

    def __init__(
        self,
        workflow: RolloutWorkflow,
        group_size: int,
        cfg: core.ConfigArg = None,
        *,
        verdict_timeout_s: float | None = None,
        on_timeout: OnTimeout = "reject",
        reduction: ProcessReduction = "mean",
        tensor_token_rewards: bool = False,
        decode: Callable[[np.ndarray], str] | None = None,
        version: Callable[[], int] | None = None,
    ) -> None:
        if group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {group_size}")
        self.settings = AdapterSettings.checked(
            on_timeout=on_timeout, reduction=reduction, verdict_timeout_s=verdict_timeout_s
        )
        self.workflow, self.group_size, self.cfg = workflow, group_size, core.load_pipeline(cfg)
        self.tensor_token_rewards, self.version = tensor_token_rewards, version
        self.client = self.settings.client(self.cfg, decode)
        self.counts: Counter[str] = Counter()
        self.last: dict[str, SampleReward] = {}  # the latest group's results by interaction id

    async def aclose(self) -> None:
        """Stop the Kafka clients (AReaL never calls this; scripts and tests do)."""
        await self.client.aclose()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, InteractionWithTokenLogpReward] | None:
        results = await asyncio.gather(*(self.workflow.arun_episode(engine, data) for _ in range(self.group_size)))
        valid = [r for r in results if r is not None]
        if not valid:
            return None
        if len(valid) < len(results):
            log.warning(
                "PRMRolloutWorkflow: %d/%d episodes returned None; scoring the rest as the group",
                len(results) - len(valid),
                len(results),
            )
        merged: dict[str, InteractionWithTokenLogpReward] = {}
        for result in valid:
            if not isinstance(result, dict) or not all(
                isinstance(v, InteractionWithTokenLogpReward) for v in result.values()
            ):
                raise TypeError(
                    "PRMRolloutWorkflow wraps workflows that return ArealOpenAI.export_interactions(...), "
                    f"got {type(result).__name__}"
                )
            merged.update(result)
        if not merged:
            return None
        version = None if self.version is None else int(self.version())
        samples = [sample_of(i, policy_version=version) for i in merged.values()]
        (rewards,) = await core.score_groups(self.client, [samples], prefix="areal")
        self.last = dict(zip(merged, rewards))
        if core.settle(rewards, self.settings, self.counts, who="PRMRolloutWorkflow"):
            return None if self.settings.on_timeout == "reject" else merged
        if not rewards[0].accepted:
            return None
        for interaction, sample, reward in zip(merged.values(), samples, rewards):
            self._write_back(interaction, sample, reward)
        return merged

    def _write_back(self, leaf: InteractionWithTokenLogpReward, sample: Sample, reward: SampleReward) -> None:
        """Set ``reward`` (and ``token_rewards`` where this AReaL has it) from the verdict."""
        full = np.concatenate([np.zeros(len(sample.prompt_ids), np.float32), reward.token_rewards])  # whole sequence
        if HAS_TOKEN_REWARDS_FIELD:
            for member in chain_of(leaf):
                start = member.model_response.input_len
                member.token_rewards = torch.from_numpy(full[start : start + member.model_response.output_len].copy())
            leaf.reward = reward.outcome
        else:
            leaf.reward = self.settings.scalar(reward)
        for member in chain_of(leaf):
            member._cache = None  # AReaL caches to_tensor_dict(), reward included
        if self.tensor_token_rewards:
            leaf.to_tensor_dict()["token_rewards"] = torch.from_numpy(full).unsqueeze(0)
