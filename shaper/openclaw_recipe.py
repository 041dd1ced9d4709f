"""OpenClaw-RL's training recipes as trainer modes, beside ours.

Ours (the default) adds the judge's score as a process token reward on top of the row's
GRPO outcome advantage. OpenClaw-RL trains differently, and a user moving from it
should be able to reproduce their signal exactly:

``openclaw_turns`` (:func:`openclaw_turn_advantages`; OpenClaw-RL's RL mode)
    every judged turn is its own sample — a group of one, so no normalisation — whose
    reward is the judge's score, broadcast as the advantage over the turn's response
    tokens. Turns without a next state or scored ``0`` are excluded, keeping at least
    one per session greedily as upstream streams them, and the session's last turn is
    dropped (:func:`shaper.exclusion.streaming_turn_keep`). No outcome reward enters.

``openclaw_combine`` (:func:`shaper.combined.openclaw_combine`; OpenClaw-RL's combine
mode) is the trainer's ``combined_mode`` of that name.

A turn's tokens of one row form one sample here: a token-level loss over the row's
masked tokens equals the sum over its turn samples (a per-sample mean loss weighs turns
differently; see docs/compatibility.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from infra.modes import JUDGE_SCORER, RECIPES

from .batch import TrainingBatch
from .exclusion import judge_turn_table, session_index, streaming_turn_keep

__all__ = ["RECIPES", "openclaw_turn_advantages", "turn_values_to_tokens"]


def turn_values_to_tokens(values: Tensor, turn_index: Tensor) -> Tensor:
    """``[B, T]``: ``values[b, turn_index[b, t]]`` on turn tokens, 0 where ``turn_index == -1``."""
    if values.shape[1] == 0:
        return torch.zeros(turn_index.shape, dtype=values.dtype, device=values.device)
    gathered = torch.gather(values, 1, turn_index.clamp(min=0).to(torch.long))
    return torch.where(turn_index >= 0, gathered, torch.zeros_like(gathered))


def openclaw_turn_advantages(
    batch: TrainingBatch, judge_scorer: str = JUDGE_SCORER, loss_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(advantages, loss_mask)``, both ``[B, T]`` unshifted, of OpenClaw-RL's RL recipe.

    ``advantages[b, t]`` is the judge's (weighted) score of the turn token ``t`` belongs
    to; ``loss_mask`` keeps the tokens of the turns :func:`~shaper.exclusion.
    streaming_turn_keep` keeps (and that ``loss_mask``, default the batch's, allows).
    """
    table = judge_turn_table(batch, judge_scorer)
    sessions = session_index(batch.group_ids, batch.session_ids, device=batch.turn_index.device)
    keep = streaming_turn_keep(table.scores, table.has_next_state, table.judged, sessions)
    base = batch.loss_mask if loss_mask is None else loss_mask
    base = base if base.dtype == torch.bool else base != 0
    token_keep = turn_values_to_tokens(keep, batch.turn_index).to(torch.bool)
    mask = base & token_keep
    advantages = torch.where(mask, turn_values_to_tokens(table.scores, batch.turn_index), 0.0)
    return advantages.to(torch.float32), mask
