"""slime / OpenClaw-RL custom reward: ``--custom-rm-path shaper.integrations.slime_rm.reward``.

slime (``slime/rollout/rm_hub``) awaits a custom reward as ``f(args, sample)`` per sample,
or — with ``--group-rm`` — as ``f(args, samples)`` once per group, expecting a list back.
Whatever it returns becomes ``sample.reward``; ``--reward-key score`` picks our scalar.

In-process, a sample carries its token ids (``tokens`` = prompt + response,
``response_length``, ``loss_mask``, ``rollout_log_probs``), so the trajectory is built
from the policy's own tokens: no re-tokenization, and ``token_rewards`` line up with the
sample's response tokens for a custom advantage or loss hook. Each run of ``loss_mask``
ones is one model turn (tool output between turns is masked out). A sample without
tokens falls back to its text and the configured tokenizer, as the gateway's ``/slime``
route does.

The answer per sample is the ``/slime`` route's: ``{"score", "outcome", "process",
"status", "reason", "group_id", "token_rewards", "turn_rewards"}``. The config is
``args.prm_config`` when slime's args carry one, else ``$PRM_CONFIG``. slime is not
installable from PyPI; the tests build samples with the attributes slime's ``Sample``
has (docs/integrations/slime.md).
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from infra.config import PipelineConfig, load_config
from shaper.reward_client import RewardClient, Sample
from shaper.text_rewards import ByteTokenizer, FileTokenizer, load_tokenizer, reward_summary

__all__ = ["VerdictTimeout", "aclose", "reward", "sample_from_slime", "score_samples"]


class VerdictTimeout(TimeoutError):
    """No verdict within ``gateway.verdict_timeout_s`` (the HTTP route answers 504)."""


class _Scorer:
    """One RewardClient per event loop (its Kafka clients belong to the loop that made them)."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.tokenizer: ByteTokenizer | FileTokenizer = load_tokenizer(cfg.gateway.tokenizer)
        self.client = RewardClient(cfg, verdict_timeout_s=cfg.gateway.verdict_timeout_s,
                                   decode=self.tokenizer.decode)


_scorers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Scorer] = weakref.WeakKeyDictionary()


def _prompt_text(prompt: Any) -> tuple[str, list[dict[str, Any]]]:
    if isinstance(prompt, str):
        return prompt, [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
        messages = [{"role": str(m.get("role", "user")), "content": m["content"]} for m in prompt]
        return "".join(m["content"] for m in messages), messages
    raise ValueError("sample.prompt must be a string or a list of messages with string 'content'")


def sample_from_slime(s: Any, tokenizer: ByteTokenizer | FileTokenizer, *, outcome: float = 0.0) -> Sample:
    """A slime ``Sample`` as our :class:`Sample`: its own tokens when it has them, else its text."""
    prompt_text, messages = _prompt_text(getattr(s, "prompt", ""))
    status = getattr(s, "status", None)
    truncated = str(getattr(status, "value", status)).lower() == "truncated"
    tokens = list(getattr(s, "tokens", None) or [])
    n = int(getattr(s, "response_length", 0) or 0)
    if tokens and 0 < n <= len(tokens):
        response = tokens[len(tokens) - n:]
        logprobs = getattr(s, "rollout_log_probs", None)
        mask = getattr(s, "loss_mask", None)
        if logprobs is not None and len(logprobs) != n:
            raise ValueError(f"sample.rollout_log_probs has {len(logprobs)} values for response_length {n}")
        if mask is not None and len(mask) != n:
            raise ValueError(f"sample.loss_mask has {len(mask)} values for response_length {n}")
        return Sample(prompt_ids=tokens[:len(tokens) - n], response_ids=response, response_logprobs=logprobs,
                      response_mask=mask, outcome_reward=outcome, messages=messages, truncated=truncated)
    response_text = getattr(s, "response", None)
    if not isinstance(response_text, str):
        raise ValueError("sample.response must be a string (or the sample must carry tokens and response_length)")
    return Sample(prompt_ids=tokenizer.encode(prompt_text), response_ids=tokenizer.encode(response_text),
                  outcome_reward=outcome, messages=messages, truncated=truncated)


def _scorer(args: Any) -> _Scorer:
    loop = asyncio.get_running_loop()
    scorer = _scorers.get(loop)
    if scorer is None:
        scorer = _scorers[loop] = _Scorer(load_config(getattr(args, "prm_config", None)))
    return scorer


async def score_samples(args: Any, samples: Sequence[Any], *, outcomes: Sequence[float] | None = None
                        ) -> list[dict[str, Any]]:
    """Score ``samples`` as one group; ``outcomes`` (e.g. slime's rule reward) are added to ``score``.

    For a custom reward that combines a rule-based outcome with process rewards:
    ``await score_samples(args, samples, outcomes=[await my_rule(args, s) for s in samples])``.
    """
    if not samples:
        raise ValueError("score_samples needs at least one sample")
    if outcomes is not None and len(outcomes) != len(samples):
        raise ValueError(f"{len(outcomes)} outcomes for {len(samples)} samples")
    scorer = _scorer(args)
    ours = [sample_from_slime(s, scorer.tokenizer, outcome=0.0 if outcomes is None else float(outcomes[i]))
            for i, s in enumerate(samples)]
    rewards = await scorer.client.score_group(ours, group_id=f"slime-{uuid.uuid4().hex}")
    if rewards[0].status == "timeout":
        raise VerdictTimeout(rewards[0].reason + " (its trajectories are published; the workers may still decide it)")
    how = scorer.cfg.gateway.process_reduction
    return [{**reward_summary(r, how), "token_rewards": r.token_rewards.tolist(), "turn_rewards": r.turn_rewards}
            for r in rewards]


async def reward(args: Any, sample_or_samples: Any, **kwargs: Any) -> dict[str, Any] | list[dict[str, Any]]:
    """slime's custom reward: one sample -> one answer (its own group); a list (``--group-rm``) -> a list.

    A rejected or discarded group is an answer with that ``status`` and ``score`` = the
    outcome (0 here); no verdict within ``gateway.verdict_timeout_s`` raises
    :class:`VerdictTimeout` naming the group, like slime's ``remote_rm`` after its retries.
    """
    if isinstance(sample_or_samples, list):
        return await score_samples(args, sample_or_samples)
    (answer,) = await score_samples(args, [sample_or_samples])
    return answer


async def aclose() -> None:
    """Close the current loop's Kafka clients (slime never calls this; tests and scripts may)."""
    scorer = _scorers.pop(asyncio.get_running_loop(), None)
    if scorer is not None:
        await scorer.client.aclose()
