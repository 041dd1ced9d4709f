"""The combiners of the combined modes: a batch's judge and OPD channels in, a signal out.

:mod:`shaper.combined` holds the pure tensor functions; these adapters read their inputs
from a :class:`~shaper.batch.TrainingBatch` (per-turn judge scores from the judge
scorer's channel, token signals from the OPD scorer's channel) and are what the
registry in :mod:`infra.modes` names as each combined mode's implementation. Every
combiner takes ``(batch, loss_mask, *, judge_scorer, opd_scorer, table)`` and works in
the generated-token alignment (unshifted); ``table`` is the judge's turn table when the
caller already built it (for the exclusion), else ``None``.
"""

from __future__ import annotations

from torch import Tensor

from infra.config import ConfigError
from infra.modes import JUDGE_SCORER, OPD_SCORER, combined_mode

from .batch import TrainingBatch
from .combined import openclaw_combine, prm_gated_opd, prm_weighted_opd, turn_scores_from_tokens
from .exclusion import JudgeTurnTable, judge_turn_table, unhinted_turns

__all__ = [
    "combined_token_signal",
    "openclaw_combine_advantage",
    "prm_gated_opd_signal",
    "prm_weighted_opd_signal",
]


def _require_channels(batch: TrainingBatch, mode: str, judge_scorer: str, opd_scorer: str) -> None:
    missing = [name for name in (judge_scorer, opd_scorer) if name not in batch.channels]
    if missing:
        raise ConfigError(
            f"combined_mode {mode!r} needs the per-scorer channels of {judge_scorer!r} (judge) and "
            f"{opd_scorer!r} (OPD); the batch has {sorted(batch.channels) or 'none'}, missing {missing}. Run the "
            "workers with worker.keep_scorer_channels: true and both scorers configured, or set "
            "trainer.judge_scorer / trainer.opd_scorer to their names"
        )


def _turn_scores(batch: TrainingBatch, judge_scorer: str) -> Tensor:
    turn_index = batch.turn_index
    num_turns = int(turn_index.max().item()) + 1 if turn_index.numel() else 0
    return turn_scores_from_tokens(batch.channels[judge_scorer], turn_index, num_turns)


def prm_weighted_opd_signal(
    batch: TrainingBatch, loss_mask: Tensor, *, judge_scorer: str, opd_scorer: str, table: JudgeTurnTable | None = None
) -> Tensor:
    """``prm_weighted_opd``: turn score x OPD token signal."""
    del table  # turn scores come from the judge's channel
    _require_channels(batch, "prm_weighted_opd", judge_scorer, opd_scorer)
    return prm_weighted_opd(batch.channels[opd_scorer], _turn_scores(batch, judge_scorer), batch.turn_index, loss_mask)


def prm_gated_opd_signal(
    batch: TrainingBatch, loss_mask: Tensor, *, judge_scorer: str, opd_scorer: str, table: JudgeTurnTable | None = None
) -> Tensor:
    """``prm_gated_opd``: OPD signals up to the first bad turn, a ``-1`` penalty there, 0 after.

    Turns without a next state are unjudged (``turn_mask``), from the judge's
    ``has_next_state`` observations: such a turn (normally the last) has nothing to be
    judged on, so its ``0`` must not cut the cascade or earn the penalty.
    """
    _require_channels(batch, "prm_gated_opd", judge_scorer, opd_scorer)
    if table is None:
        table = judge_turn_table(batch, judge_scorer, needed_by="trainer.combined_mode prm_gated_opd")
    return prm_gated_opd(
        batch.channels[opd_scorer],
        _turn_scores(batch, judge_scorer),
        batch.turn_index,
        loss_mask,
        turn_mask=table.judged & table.has_next_state,
    )


def openclaw_combine_advantage(
    batch: TrainingBatch, loss_mask: Tensor, *, judge_scorer: str, opd_scorer: str, table: JudgeTurnTable | None = None
) -> tuple[Tensor, Tensor]:
    """``openclaw_combine``: :func:`shaper.combined.openclaw_combine`'s ``(advantages, loss_mask)``;
    the scorers' weights already scale the channels, so they play ``w_rl`` (judge) and ``w_opd`` (OPD)."""
    del table
    _require_channels(batch, "openclaw_combine", judge_scorer, opd_scorer)
    hinted = ~unhinted_turns(batch, opd_scorer)
    return openclaw_combine(
        batch.channels[opd_scorer], _turn_scores(batch, judge_scorer), hinted, batch.turn_index, loss_mask
    )


def combined_token_signal(
    batch: TrainingBatch,
    mode: str,
    *,
    loss_mask: Tensor | None = None,
    judge_scorer: str = JUDGE_SCORER,
    opd_scorer: str = OPD_SCORER,
    table: JudgeTurnTable | None = None,
) -> Tensor:
    """The ``[B, T]`` token signal of the combined mode ``mode`` (unshifted, 0 off the loss mask).

    ``ValueError`` for an unknown mode, and for one that yields an advantage rather than a
    signal (``openclaw_combine``: use :func:`shaper.trainer.shape_batch`).
    """
    info = combined_mode(mode)
    if info.yields != "signal":
        raise ConfigError(f"{mode} yields an advantage and a mask, not a token signal: use shape_batch")
    mask = batch.loss_mask if loss_mask is None else loss_mask
    return info.resolve()(batch, mask, judge_scorer=judge_scorer, opd_scorer=opd_scorer, table=table)
