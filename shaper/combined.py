"""PRM + OPD combined token signals, pure and vectorised.

OPD's token signal ``teacher_lp - rollout_lp`` says *how* each token should change,
but it is conditioned on everything the policy wrote before: once a turn went wrong,
the teacher's opinion of later tokens is "cascade-contaminated". A turn-level PRM
(the judge's ``+1/0/-1`` per turn) says *where* things went wrong. Two ways to
combine them:

:func:`prm_gated_opd` (ours: "PRM as OPD's validity gate")
    walking a branch's turns in order: a turn the judge scored ``> 0`` keeps its OPD
    token signals; the **first** turn scored ``<= 0`` gets a uniform ``penalty``
    (``-1``) on every token, and every later turn of the branch gets ``0`` — the
    cascade is cut there.
:func:`prm_weighted_opd` (ours: "hierarchical advantage")
    token signal = turn score × OPD token signal: the PRM decides the weight and sign
    of a turn, OPD the direction inside it.
:func:`openclaw_combine` (OpenClaw-RL's ``openclaw-combine``)
    per turn, a dispatch between the OPD signal and the judge signal:
    ``w_opd · (teacher − old) + w_rl · score``, turns with neither signal dropped.
    Unlike the two above it yields the advantage itself and a loss mask.

Inputs (one row per branch/sequence; every tensor on the same device):

``opd_token_signals``  ``[B, T]`` float — OPD signal per token (0 where undefined).
``turn_scores``        ``[B, K]`` float — judge score of turn ``k`` of row ``b``;
                       turns are numbered in branch order (``k = 0`` is the first).
``turn_index``         ``[B, T]`` integer — the turn each token belongs to, ``-1``
                       for prompt / padding / non-output positions; ``< K``.
``loss_mask``          ``[B, T]`` bool or numeric — non-zero = trained position.

Positions with ``turn_index == -1`` or ``loss_mask == 0`` are always ``0`` in the
output. Apply these functions to signals in the *generated-token* alignment and shift
the result with :func:`shaper.shaping.shift_token_rewards` (or shift all inputs
consistently): they are position-wise, so either order gives the same result.

Like :mod:`shaper.shaping`, nothing here loops over rows or tokens in Python; the only
host synchronisation is the range check of ``turn_index`` (a bad index must raise,
not silently gather another turn's score).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from shaper.errors import ShapingInputError

__all__ = ["openclaw_combine", "prm_gated_opd", "prm_weighted_opd", "turn_scores_from_tokens"]


def turn_scores_from_tokens(token_values: Tensor, turn_index: Tensor, num_turns: int) -> Tensor:
    """``[B, K]`` mean of ``token_values [B, T]`` over each turn's tokens (0 for a turn without tokens).

    Turns a per-token channel back into per-turn scores: a judge's channel is uniform
    over each turn (its weighted ``+1/0/-1``), so the mean *is* the turn's score, and for
    a non-uniform scorer it is exactly how :class:`~infra.schema.PRMTurnResult` defines a
    turn reward. Positions with ``turn_index == -1`` do not count. One ``scatter_add``
    each for sums and counts, no loop.
    """
    if token_values.dim() != 2 or tuple(turn_index.shape) != tuple(token_values.shape):
        raise ShapingInputError(
            f"token_values and turn_index must be [B, T] of the same shape; got {tuple(token_values.shape)} "
            f"and {tuple(turn_index.shape)}"
        )
    b = token_values.shape[0]
    values = token_values.float()
    inside = turn_index >= 0
    k = torch.where(inside, turn_index, torch.full_like(turn_index, num_turns)).to(torch.long)
    sums = torch.zeros(b, num_turns + 1, dtype=values.dtype, device=values.device)  # slot K collects the rest
    counts = torch.zeros_like(sums)
    sums.scatter_add_(1, k, torch.where(inside, values, torch.zeros_like(values)))
    counts.scatter_add_(1, k, inside.to(values.dtype))
    return (sums / counts.clamp(min=1))[:, :num_turns].to(token_values.dtype)


def _check(opd: Tensor, turn_scores: Tensor, turn_index: Tensor, loss_mask: Tensor) -> None:
    if opd.dim() != 2:
        raise ShapingInputError(f"opd_token_signals must be 2-D [B, T]; got shape {tuple(opd.shape)}")
    if not opd.is_floating_point():
        raise ShapingInputError(f"opd_token_signals must be floating point, got dtype {opd.dtype}")
    if tuple(turn_index.shape) != tuple(opd.shape) or tuple(loss_mask.shape) != tuple(opd.shape):
        raise ShapingInputError(
            "opd_token_signals, turn_index and loss_mask must have the same [B, T] shape; got "
            f"{tuple(opd.shape)}, {tuple(turn_index.shape)}, {tuple(loss_mask.shape)}"
        )
    if turn_scores.dim() != 2 or turn_scores.shape[0] != opd.shape[0]:
        raise ShapingInputError(
            f"turn_scores must be [B, K] with B = {opd.shape[0]}; got shape {tuple(turn_scores.shape)}"
        )
    if turn_index.dtype.is_floating_point or turn_index.dtype == torch.bool or turn_index.is_complex():
        raise ShapingInputError(f"turn_index must be an integer tensor, got dtype {turn_index.dtype}")
    devices = {opd.device, turn_scores.device, turn_index.device, loss_mask.device}
    if len(devices) != 1:
        raise ShapingInputError(f"all inputs must be on the same device; got {sorted(map(str, devices))}")
    if turn_index.numel():
        lo, hi = (int(v) for v in turn_index.aminmax())
        k = turn_scores.shape[1]
        if lo < -1 or hi >= k:
            raise ShapingInputError(f"turn_index must lie in [-1, K) with K = {k} turns; found values in [{lo}, {hi}]")


def _token_turns(turn_scores: Tensor, turn_index: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(active, k)``: trained output positions and their turn index clamped to ``>= 0``."""
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    active = mask & (turn_index >= 0)
    return active, turn_index.clamp(min=0).to(torch.long)


def prm_weighted_opd(opd_token_signals: Tensor, turn_scores: Tensor, turn_index: Tensor, loss_mask: Tensor) -> Tensor:
    """``turn_scores[b, turn_index[b, t]] * opd_token_signals[b, t]`` on active positions, else 0.

    Returns a new ``[B, T]`` tensor with ``opd_token_signals``' dtype and device.
    """
    _check(opd_token_signals, turn_scores, turn_index, loss_mask)
    active, k = _token_turns(turn_scores, turn_index, loss_mask)
    if turn_scores.shape[1] == 0:  # no turns: every position is inactive
        return torch.zeros_like(opd_token_signals)
    per_token = torch.gather(turn_scores.to(opd_token_signals.dtype), 1, k)
    return torch.where(active, per_token * opd_token_signals, torch.zeros_like(opd_token_signals))


def prm_gated_opd(
    opd_token_signals: Tensor,
    turn_scores: Tensor,
    turn_index: Tensor,
    loss_mask: Tensor,
    *,
    penalty: float = -1.0,
    turn_mask: Tensor | None = None,
) -> Tensor:
    """Gate OPD signals by the PRM, turn by turn, cutting the cascade at the first bad turn.

    For row ``b``, let ``f`` be its first turn with ``turn_scores[b, f] <= 0`` (a
    neutral ``0`` counts as not good). Then, on active positions:

    * tokens of turns ``k < f`` (all judged good) get their OPD signal;
    * tokens of turn ``f`` get ``penalty`` (default ``-1``) — a uniform penalty that
      does not use the contaminated teacher log-probs;
    * tokens of turns ``k > f`` get ``0``.

    ``turn_mask`` (optional ``[B, K]`` bool) marks turns that were actually judged;
    an unjudged turn (e.g. the branch's last turn, which has no next state and scores
    ``0`` by convention) neither passes OPD (its tokens get ``0``) nor cuts the
    cascade. Without it every turn counts as judged.
    A NaN score counts as not good.

    Returns a new ``[B, T]`` tensor with ``opd_token_signals``' dtype and device.
    """
    _check(opd_token_signals, turn_scores, turn_index, loss_mask)
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
        raise ShapingInputError(f"penalty must be a finite number, got {penalty!r}")
    b, num_turns = turn_scores.shape
    if turn_mask is None:
        judged = torch.ones_like(turn_scores, dtype=torch.bool)
    else:
        if tuple(turn_mask.shape) != (b, num_turns) or turn_mask.device != turn_scores.device:
            raise ShapingInputError(
                f"turn_mask must be a [B, K] = {(b, num_turns)} tensor on {turn_scores.device}; "
                f"got {tuple(turn_mask.shape)} on {turn_mask.device}"
            )
        judged = turn_mask if turn_mask.dtype == torch.bool else turn_mask != 0
    zeros = torch.zeros_like(opd_token_signals)
    if num_turns == 0:
        return zeros
    active, k = _token_turns(turn_scores, turn_index, loss_mask)
    good = (turn_scores > 0) & judged
    bad = ~(turn_scores > 0) & judged  # NaN > 0 is False: NaN counts as bad
    order = torch.arange(num_turns, device=turn_scores.device).expand(b, num_turns)
    first_bad = torch.where(bad, order, torch.full_like(order, num_turns)).amin(dim=1, keepdim=True)  # [B, 1]
    token_good = torch.gather(good, 1, k)
    before = k < first_bad
    at = k == first_bad
    out = torch.where(before & token_good, opd_token_signals, zeros)
    out = torch.where(at, torch.full_like(opd_token_signals, float(penalty)), out)
    return torch.where(active, out, zeros)


def openclaw_combine(
    opd_token_signals: Tensor,
    turn_scores: Tensor,
    hint_accepted: Tensor,
    turn_index: Tensor,
    loss_mask: Tensor,
    *,
    w_opd: float = 1.0,
    w_rl: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """OpenClaw-RL's combine advantage: ``(advantages, loss_mask)``, both ``[B, T]``.

    Per turn (``hint_accepted`` ``[B, K]`` bool: the OPD hint judge accepted a hint;
    ``turn_scores`` ``[B, K]``: the PRM judge's majority, ``±1`` is a signal, ``0`` none):

    ============  ===========  =========================================
    hint          score ±1     advantage per token ``i`` of the turn
    ============  ===========  =========================================
    yes           yes          ``w_opd · opd_i + w_rl · score``
    yes           no           ``w_opd · opd_i``
    no            yes          ``w_rl · score`` (teacher = rollout: no OPD term)
    no            no           turn dropped (loss mask 0)
    ============  ===========  =========================================

    ``opd_token_signals`` is ``teacher_lp − old_lp`` per token. No normalisation (each
    turn is a group of one upstream), no outcome advantage. The returned mask is
    ``loss_mask`` restricted to turns with a signal.
    """
    _check(opd_token_signals, turn_scores, turn_index, loss_mask)
    for name, value in (("w_opd", w_opd), ("w_rl", w_rl)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ShapingInputError(f"{name} must be a finite number, got {value!r}")
    if tuple(hint_accepted.shape) != tuple(turn_scores.shape) or hint_accepted.device != turn_scores.device:
        raise ShapingInputError(
            f"hint_accepted must be [B, K] = {tuple(turn_scores.shape)} on {turn_scores.device}; got "
            f"{tuple(hint_accepted.shape)} on {hint_accepted.device}"
        )
    zeros = torch.zeros_like(opd_token_signals)
    if turn_scores.shape[1] == 0:
        return zeros, torch.zeros_like(zeros, dtype=torch.bool)
    active, k = _token_turns(turn_scores, turn_index, loss_mask)
    hint = hint_accepted if hint_accepted.dtype == torch.bool else hint_accepted != 0
    rl = (turn_scores != 0) & ~torch.isnan(turn_scores)
    tok_hint = torch.gather(hint, 1, k)
    tok_rl = torch.gather(rl, 1, k)
    score = torch.gather(torch.where(rl, turn_scores, torch.zeros_like(turn_scores)).to(zeros.dtype), 1, k)
    mask = active & (tok_hint | tok_rl)
    advantage = torch.where(tok_hint, float(w_opd) * opd_token_signals, zeros) + float(w_rl) * score
    return torch.where(mask, advantage, zeros), mask
