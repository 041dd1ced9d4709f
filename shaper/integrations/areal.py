"""AReaL integration: a ``RolloutWorkflow`` wrapper that scores each group's exported episodes through the pipeline.

The only module of the project that imports ``areal`` (tested against AReaL 1.0.4; see
docs/integrations/areal.md). :class:`PRMRolloutWorkflow` wraps an agent workflow the
way AReaL's ``GroupedRolloutWorkflow`` does — it runs ``group_size`` episodes of it
for one data item — but before handing the group to AReaL it

1. turns every exported interaction (``ArealOpenAI.export_interactions(...)``: with
   ``style="concat"`` the leaves, each carrying its whole conversation) into one
   sample: the token ids, the behaviour log-probs and the loss mask AReaL's own
   ``to_tensor_dict()`` builds, the reward the workflow set as the outcome;
2. publishes the group and waits, bounded, for its verdict;
3. writes the result back where AReaL reads it:

   * AReaL versions whose ``InteractionWithTokenLogpReward`` has a ``token_rewards``
     field (AReaL's Process Rewards): each interaction on the leaf's chain gets its
     own output tokens' process rewards there, and ``reward`` stays the outcome —
     AReaL's actor shapes advantages with them;
   * AReaL 1.0.4 (``reward`` only): ``reward`` becomes outcome + the reduction
     (``mean`` by default) of the process rewards, so a stock 1.0.4 trainer learns
     from them; with ``tensor_token_rewards=True`` the leaf's ``to_tensor_dict()``
     also carries ``token_rewards`` ``[1, L]`` aligned with ``input_ids`` (0 off the
     generated tokens, unshifted) for an actor or the project's shaper to read.

A group the workers reject (or discard) is rejected for AReaL too (``None``: AReaL's
Process Rewards reject a group when a member fails). A verdict that does not come in
time rejects the group by default (``on_timeout="reject"``); ``outcome_only`` keeps the
workflow's rewards untouched and ``raise`` stops the rollout — never a silent 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from os import PathLike
from typing import Any, Literal

import numpy as np
import torch
from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.types import InteractionWithTokenLogpReward

from infra.config import PipelineConfig, load_config
from shaper.reward_client import ProcessReduction, RewardClient, Sample, SampleReward, reduce_process

log = logging.getLogger(__name__)

__all__ = ["HAS_TOKEN_REWARDS_FIELD", "PRMRolloutWorkflow", "VerdictTimeout", "chain_of", "sample_of"]

HAS_TOKEN_REWARDS_FIELD = "token_rewards" in {f.name for f in dataclasses.fields(InteractionWithTokenLogpReward)}
"""Whether this AReaL's interactions carry per-token process rewards (1.0.4: no)."""

OnTimeout = Literal["reject", "outcome_only", "raise"]


class VerdictTimeout(TimeoutError):
    """A group's verdict did not arrive in time (raised with ``on_timeout="raise"``)."""


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
        raise ValueError(f"interaction {interaction.interaction_id!r} has no model_response (token-backed "
                         "interactions only: export from ArealOpenAI)")
    td = _tensor_dict(interaction)
    ids = td["input_ids"][0].numpy()
    mask = td["loss_mask"][0].numpy().astype(bool)
    if not mask.any():
        raise ValueError(f"interaction {interaction.interaction_id!r} has no generated tokens to score")
    start = int(np.argmax(mask))
    root = chain_of(interaction)[0]
    return Sample(prompt_ids=ids[:start], response_ids=ids[start:], response_logprobs=td["logprobs"][0].numpy()[start:],
                  response_mask=mask[start:].astype(np.int8), outcome_reward=float(interaction.reward or 0.0),
                  messages=list(root.messages or []), policy_version=policy_version,
                  truncated=interaction.model_response.stop_reason == "length")


class PRMRolloutWorkflow(RolloutWorkflow):
    """``GroupedRolloutWorkflow`` that scores the group through the pipeline before AReaL trains on it.

    Args:
        workflow: an AReaL workflow whose ``arun_episode`` returns
            ``ArealOpenAI.export_interactions(...)`` (interactions with token data).
        group_size: episodes per data item (AReaL's ``gconfig.n_samples``).
        cfg: the pipeline config or a YAML path (``None``: ``$PRM_CONFIG``).
        verdict_timeout_s: bound on the wait (default the workers' ``group_timeout_s`` + 30 s).
        on_timeout: ``reject`` (default), ``outcome_only`` or ``raise``.
        reduction: process rewards -> the scalar added to ``reward`` where the
            interaction has no ``token_rewards`` field.
        tensor_token_rewards: also put ``token_rewards`` into each leaf's tensor dict.
        decode: token ids -> text, for scorers that read each turn's words (e.g. the
            tokenizer's ``decode``).
        version: the policy version the episodes were sampled with (a callable, read
            per group, e.g. ``engine.get_version``).
    """

    def __init__(self, workflow: RolloutWorkflow, group_size: int, cfg: PipelineConfig | str | PathLike | None = None,
                 *, verdict_timeout_s: float | None = None, on_timeout: OnTimeout = "reject",
                 reduction: ProcessReduction = "mean", tensor_token_rewards: bool = False,
                 decode: Callable[[np.ndarray], str] | None = None, version: Callable[[], int] | None = None) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if on_timeout not in ("reject", "outcome_only", "raise"):
            raise ValueError(f"on_timeout must be 'reject', 'outcome_only' or 'raise', got {on_timeout!r}")
        if reduction not in ("mean", "sum", "last"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'last', got {reduction!r}")
        self.workflow = workflow
        self.group_size = group_size
        self.cfg = cfg if isinstance(cfg, PipelineConfig) else load_config(None if cfg is None else str(cfg))
        self.on_timeout: OnTimeout = on_timeout
        self.reduction: ProcessReduction = reduction
        self.tensor_token_rewards = tensor_token_rewards
        self.version = version
        self.client = RewardClient(self.cfg, verdict_timeout_s=verdict_timeout_s, decode=decode)
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
            log.warning("PRMRolloutWorkflow: %d/%d episodes returned None; scoring the rest as the group",
                        len(results) - len(valid), len(results))
        merged: dict[str, InteractionWithTokenLogpReward] = {}
        for result in valid:
            if not isinstance(result, dict) or not all(isinstance(v, InteractionWithTokenLogpReward)
                                                        for v in result.values()):
                raise TypeError("PRMRolloutWorkflow wraps workflows that return ArealOpenAI.export_interactions(...), "
                                f"got {type(result).__name__}")
            merged.update(result)
        if not merged:
            return None
        version = None if self.version is None else int(self.version())
        samples = [sample_of(i, policy_version=version) for i in merged.values()]
        group_id = f"areal-{uuid.uuid4().hex}"
        rewards = await self.client.score_group(samples, group_id=group_id)
        self.last = dict(zip(merged, rewards))
        for r in rewards:
            self.counts[r.status] += 1
        status, reason = rewards[0].status, rewards[0].reason
        if status == "timeout":
            if self.on_timeout == "raise":
                raise VerdictTimeout(reason)
            log.warning("PRMRolloutWorkflow: %s (%s)", reason,
                        "group rejected" if self.on_timeout == "reject" else "the workflow's rewards stand")
            return None if self.on_timeout == "reject" else merged
        if status != "accepted":
            log.info("PRMRolloutWorkflow: group %s %s by the workers (%s): rejected", group_id, status, reason)
            return None
        for interaction, sample, reward in zip(merged.values(), samples, rewards):
            self._write_back(interaction, sample, reward)
        return merged

    def _write_back(self, leaf: InteractionWithTokenLogpReward, sample: Sample, reward: SampleReward) -> None:
        """Set ``reward`` (and ``token_rewards`` where this AReaL has it) from the verdict."""
        sequence_len = len(sample.prompt_ids) + len(sample.response_ids)
        full = np.zeros(sequence_len, dtype=np.float32)  # process rewards on the leaf's whole sequence
        full[len(sample.prompt_ids):] = reward.token_rewards
        if HAS_TOKEN_REWARDS_FIELD:
            for member in chain_of(leaf):
                start = member.model_response.input_len
                member.token_rewards = torch.from_numpy(full[start:start + member.model_response.output_len].copy())
            leaf.reward = reward.outcome
        else:
            leaf.reward = reward.outcome + reduce_process(reward, self.reduction)
        for member in chain_of(leaf):
            member._cache = None  # AReaL caches to_tensor_dict(), reward included
        if self.tensor_token_rewards:
            leaf.to_tensor_dict()["token_rewards"] = torch.from_numpy(full).unsqueeze(0)
