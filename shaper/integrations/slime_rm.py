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
route does; both answer through :func:`shaper.integrations.core.slime_scores`:
``{"score", "outcome", "process", "status", "reason_code", "reason", "group_id",
"token_rewards", "turn_rewards"}`` per sample. The config is ``args.prm_config`` when
slime's args carry one, else ``$PRM_CONFIG``. slime is not installable from PyPI; the
tests build samples with the attributes slime's ``Sample`` has (docs/integrations/slime.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infra.config import load_config
from shaper.integrations.core import PerLoop, ShapingInputError, TextScorer, VerdictTimeout, slime_scores
from shaper.reward_client import Sample
from shaper.text_rewards import ByteTokenizer, FileTokenizer, load_tokenizer, prompt_messages

__all__ = ["VerdictTimeout", "aclose", "load_tokenizer", "reward", "sample_from_slime", "score_samples"]

_scorers: PerLoop[TextScorer] = PerLoop()


def sample_from_slime(s: Any, tokenizer: ByteTokenizer | FileTokenizer, *, outcome: float = 0.0) -> Sample:
    """A slime ``Sample`` as our :class:`Sample`: its own tokens when it has them, else its text."""
    prompt_text, messages = prompt_messages(getattr(s, "prompt", ""), "sample.prompt")
    status = getattr(s, "status", None)
    truncated = str(getattr(status, "value", status)).lower() == "truncated"
    tokens = list(getattr(s, "tokens", None) or [])
    n = int(getattr(s, "response_length", 0) or 0)
    if tokens and 0 < n <= len(tokens):
        logprobs = getattr(s, "rollout_log_probs", None)
        mask = getattr(s, "loss_mask", None)
        for name, values in (("rollout_log_probs", logprobs), ("loss_mask", mask)):
            if values is not None and len(values) != n:
                raise ShapingInputError(f"sample.{name} has {len(values)} values for response_length {n}")
        return Sample(
            prompt_ids=tokens[: len(tokens) - n],
            response_ids=tokens[len(tokens) - n :],
            response_logprobs=logprobs,
            response_mask=mask,
            outcome_reward=outcome,
            messages=messages,
            truncated=truncated,
        )
    response_text = getattr(s, "response", None)
    if not isinstance(response_text, str):
        raise ShapingInputError(
            "sample.response must be a string (or the sample must carry tokens and response_length)"
        )
    return Sample(
        prompt_ids=tokenizer.encode(prompt_text),
        response_ids=tokenizer.encode(response_text),
        outcome_reward=outcome,
        messages=messages,
        truncated=truncated,
    )


async def score_samples(
    args: Any, samples: Sequence[Any], *, outcomes: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """Score ``samples`` as one group; ``outcomes`` (e.g. slime's rule reward) are added to ``score``.

    For a custom reward that combines a rule-based outcome with process rewards:
    ``await score_samples(args, samples, outcomes=[await my_rule(args, s) for s in samples])``.
    """
    if not samples:
        raise ShapingInputError("score_samples needs at least one sample")
    if outcomes is not None and len(outcomes) != len(samples):
        raise ShapingInputError(f"{len(outcomes)} outcomes for {len(samples)} samples")
    path = getattr(args, "prm_config", None)
    scorer = _scorers.get(path, lambda: TextScorer(load_config(path)))
    ours = [
        sample_from_slime(s, scorer.tokenizer, outcome=0.0 if outcomes is None else float(outcomes[i]))
        for i, s in enumerate(samples)
    ]
    return await slime_scores(scorer.client, scorer.cfg.gateway, ours)


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
    await _scorers.aclose()
