r"""OpenClaw-RL's exclusion policy for judged turns, trainer-side and vectorised.

OpenClaw-RL trains on a turn only when its judge said something: a turn the judge
scored ``0`` (neutral: "not enough information") or one that has **no next state** (the
session's last turn, so there was nothing to judge) gets ``loss_mask = 0``. On its own
that can silence a whole session — five neutral turns contribute nothing, and a
session that never produces a sample starves ``rollout_batch_size`` — so it keeps an
**at-least-one guarantee**: if a session has no effective turn, its first judged turn
that had a next state is trained on anyway (OpenClaw-RL's at-least-one guarantee).

Here the rule is applied where the trainer sees whole sessions, to the concat rows of a
:class:`~shaper.batch.TrainingBatch`:

* a turn ``(b, k)`` — row ``b``'s ``k``-th turn, i.e. the tokens with
  ``turn_index[b, t] == k`` — is **excluded** when it was judged and its score is ``0``
  or it has no next state;
* a session's **effective** turns are its judged turns that are not excluded; rows of
  one session (one per branch) are pooled, a shared ancestor counting once per row,
  exactly as the metrics count it;
* a session with no effective turn keeps its **first candidate**: the first judged turn
  with a next state in row order, then turn order (for a linear session: its earliest
  turn that had a next state). A session without any candidate (every turn lacks a next
  state) keeps nothing — there is no judged signal to keep.

Turns without a judge result keep their mask: no information is not a neutral verdict.

OpenClaw-RL's server decides each turn as it arrives, so there the guarantee reads
"no effective turn *so far*": a leading neutral turn is kept even when a later turn
turns out effective. The trainer knows the whole session, so it applies the rule as
stated ("when every turn of a session is neutral") and never keeps a neutral turn of a
session that has a real signal.

:func:`streaming_turn_keep` is OpenClaw-RL's own, streaming form of the rule (used by
the ``openclaw_turns`` recipe, :mod:`shaper.openclaw_recipe`): a session's first turn
with a next state is always kept, effective or not, and its last turn never is.
:func:`unhinted_turns` marks the turns OpenClaw-RL's OPD does not train (no accepted
hint, or the teacher failed) for the trainer's ``drop_unhinted_turns``.

Inputs come from the verdicts: the judge scorer's per-turn results
(:attr:`~infra.schema.SessionResult.turn_results`; reward ``0`` means neutral, the
``has_next_state`` turn observation ``false`` means no next state), laid out per row by
:func:`judge_turn_table`, then mapped onto tokens through ``turn_index`` by
:func:`exclude_neutral_turns` — pure torch, no loop over rows or tokens, on the
tensors' device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from infra.modes import JUDGE_SCORER, OPD_SCORER
from infra.schema import PRMMetricObservation
from shaper.errors import ShapingInputError

from .batch import TrainingBatch

__all__ = [
    "JudgeTurnTable",
    "apply_exclusion",
    "exclude_neutral_turns",
    "judge_turn_table",
    "session_index",
    "streaming_turn_keep",
    "turn_flag_table",
    "unhinted_turns",
]

HAS_NEXT_STATE = "has_next_state"


@dataclass(frozen=True, slots=True)
class JudgeTurnTable:
    """Per-row, per-turn judge results as ``[B, K]`` tensors (``K`` = most turns in a row).

    ``scores``: the judge's turn reward (weighted; 0 where unjudged). ``has_next_state``:
    the turn's observation (``True`` when the scorer does not report it). ``judged``: the
    row has a judge result for turn ``k`` (false for the slots past a row's last turn).
    """

    scores: Tensor  # float32 [B, K]
    has_next_state: Tensor  # bool [B, K]
    judged: Tensor  # bool [B, K]

    def to(self, device: str | torch.device) -> JudgeTurnTable:
        return JudgeTurnTable(self.scores.to(device), self.has_next_state.to(device), self.judged.to(device))


def judge_turn_table(
    batch: TrainingBatch, scorer: str = JUDGE_SCORER, *, needed_by: str = "trainer.exclude_neutral_turns"
) -> JudgeTurnTable:
    """Lay the ``scorer``'s per-turn results of every row of ``batch`` out as ``[B, K]``.

    ``needed_by`` names the setting that asked for the table, so the error says which
    one to change (not one the user never turned on).

    Work is per turn (a few Python operations per judged turn), never per token. Raises
    :class:`ValueError` naming the row when a row has no results of ``scorer``: every
    turn of a scored session has one result per active scorer, so a missing judge means
    a wrong ``trainer.judge_scorer`` or verdicts scored without the judge — training on
    them as if nothing were neutral would silently disable the policy.
    """
    n = batch.batch_size
    num_turns = int(batch.turn_index.max().item()) + 1 if batch.turn_index.numel() else 0
    scores = np.zeros((n, num_turns), dtype=np.float32)
    has_next = np.zeros((n, num_turns), dtype=bool)
    judged = np.zeros((n, num_turns), dtype=bool)
    if len(batch.turn_results) != n:
        raise ShapingInputError(
            f"batch has {n} rows but turn results for {len(batch.turn_results)}; build it with "
            "shaper.batch.collate / build_training_batch"
        )
    for b, by_scorer in enumerate(batch.turn_results):
        results = by_scorer.get(scorer)
        if results is None:
            known = sorted(by_scorer)
            raise ShapingInputError(
                f"row {b} (session {batch.session_ids[b]!r}, leaf {batch.leaf_ids[b]!r}) has no per-turn "
                f"results of scorer {scorer!r} (it has {known or 'none'}), which {needed_by} needs; set "
                f"trainer.judge_scorer to the judge's name, configure the judge on the workers, or turn "
                f"{needed_by} off"
            )
        k = len(results)
        if k > num_turns:
            raise ShapingInputError(f"row {b}: {k} judge results but the row has only {num_turns} turns")
        scores[b, :k] = [tr.reward for tr in results]
        has_next[b, :k] = [_has_next_state(tr.observations) for tr in results]
        judged[b, :k] = True
    device = batch.turn_index.device
    return JudgeTurnTable(
        torch.from_numpy(scores).to(device), torch.from_numpy(has_next).to(device), torch.from_numpy(judged).to(device)
    )


def _has_next_state(observations: Sequence[PRMMetricObservation]) -> bool:
    """The turn's ``has_next_state`` observation; ``True`` when the scorer does not report one."""
    for obs in observations:
        if obs.metric_id == HAS_NEXT_STATE:
            return bool(obs.value)
    return True


def session_index(group_ids: Sequence[str], session_ids: Sequence[str], device: str | torch.device = "cpu") -> Tensor:
    """``[B]`` int64: the same number for rows of the same (group, session), in order of first appearance."""
    ids: dict[tuple[str, str], int] = {}
    index = [ids.setdefault(key, len(ids)) for key in zip(group_ids, session_ids)]
    return torch.tensor(index, dtype=torch.long, device=device)


def exclude_neutral_turns(
    loss_mask: Tensor,
    turn_index: Tensor,
    turn_scores: Tensor,
    has_next_state: Tensor,
    sessions: Tensor,
    judged: Tensor | None = None,
) -> Tensor:
    """The loss mask with OpenClaw-RL's excluded turns removed (see the module docstring).

    Args:
        loss_mask: ``[B, T]`` bool or numeric (non-zero = trained), unshifted.
        turn_index: ``[B, T]`` integer, ``k`` on turn ``k``'s output tokens, ``-1``
            elsewhere (``TrainingBatch.turn_index``); values must lie in ``[-1, K)``.
        turn_scores: ``[B, K]`` the judge's score of each turn (``0`` = neutral).
        has_next_state: ``[B, K]`` bool.
        sessions: ``[B]`` integer session number per row (:func:`session_index`); rows
            of one session are pooled for the at-least-one guarantee.
        judged: ``[B, K]`` bool, turns that have a judge result (default: all).

    Returns:
        A new ``[B, T]`` bool tensor: ``loss_mask`` and not an excluded turn. Positions
        outside any turn (``turn_index == -1``) keep ``loss_mask``.
    """
    if loss_mask.dim() != 2 or tuple(turn_index.shape) != tuple(loss_mask.shape):
        raise ShapingInputError(
            f"loss_mask and turn_index must be [B, T] of the same shape; got {tuple(loss_mask.shape)} "
            f"and {tuple(turn_index.shape)}"
        )
    b = loss_mask.shape[0]
    if turn_index.dtype.is_floating_point or turn_index.dtype == torch.bool:
        raise ShapingInputError(f"turn_index must be an integer tensor, got dtype {turn_index.dtype}")
    if turn_scores.dim() != 2 or turn_scores.shape[0] != b or tuple(has_next_state.shape) != tuple(turn_scores.shape):
        raise ShapingInputError(
            f"turn_scores and has_next_state must be [B, K] with B = {b}; got {tuple(turn_scores.shape)} "
            f"and {tuple(has_next_state.shape)}"
        )
    if tuple(sessions.shape) != (b,):
        raise ShapingInputError(f"sessions must be [B] = [{b}], got {tuple(sessions.shape)}")
    num_turns = turn_scores.shape[1]
    if judged is None:
        judged = torch.ones_like(has_next_state, dtype=torch.bool)
    elif tuple(judged.shape) != tuple(turn_scores.shape):
        raise ShapingInputError(f"judged must be [B, K] = {tuple(turn_scores.shape)}, got {tuple(judged.shape)}")
    mask = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    if turn_index.numel():
        lo, hi = (int(v) for v in turn_index.aminmax())  # a bad index must raise, not gather another turn
        if lo < -1 or hi >= num_turns:
            raise ShapingInputError(
                f"turn_index must lie in [-1, K) with K = {num_turns}; found values in [{lo}, {hi}]"
            )
    if num_turns == 0 or b == 0:
        return mask.clone()
    device = turn_scores.device
    judged = judged.to(torch.bool)
    nxt = has_next_state.to(torch.bool)
    excluded = judged & (~nxt | (turn_scores == 0))
    effective = judged & ~excluded
    sessions = sessions.to(device=device, dtype=torch.long)
    n_sessions = int(sessions.max().item()) + 1
    # Does the session have any effective turn? (max over its rows' turns)
    row_effective = effective.any(dim=1).to(torch.long)
    session_effective = torch.zeros(n_sessions, dtype=torch.long, device=device).scatter_reduce(
        0, sessions, row_effective, reduce="amax", include_self=True
    )
    # Its first candidate in (row, turn) order: the smallest key row * K + k.
    rows = torch.arange(b, device=device).unsqueeze(1)
    key = rows * num_turns + torch.arange(num_turns, device=device)  # [B, K]
    never = b * num_turns
    candidate_key = torch.where(judged & nxt, key, torch.full_like(key, never)).amin(dim=1)  # [B]
    first = torch.full((n_sessions,), never, dtype=torch.long, device=device).scatter_reduce(
        0, sessions, candidate_key, reduce="amin", include_self=True
    )
    rescued = (key == first[sessions].unsqueeze(1)) & (session_effective[sessions] == 0).unsqueeze(1)
    keep_turn = ~excluded | rescued  # [B, K]
    token_keep = torch.gather(keep_turn, 1, turn_index.clamp(min=0).to(torch.long))
    return mask & ((turn_index < 0) | token_keep)


def apply_exclusion(batch: TrainingBatch, scorer: str = JUDGE_SCORER, loss_mask: Tensor | None = None) -> Tensor:
    """:func:`exclude_neutral_turns` for a :class:`TrainingBatch` (``loss_mask`` defaults to the batch's)."""
    table = judge_turn_table(batch, scorer)
    sessions = session_index(batch.group_ids, batch.session_ids, device=batch.turn_index.device)
    return exclude_neutral_turns(
        batch.loss_mask if loss_mask is None else loss_mask,
        batch.turn_index,
        table.scores,
        table.has_next_state,
        sessions,
        table.judged,
    )


def turn_flag_table(batch: TrainingBatch, scorer: str, metric: str, *, default: bool) -> tuple[Tensor, Tensor]:
    """``(flags, present)``: ``[B, K]`` bool of ``scorer``'s boolean turn observation
    ``metric`` (``default`` where the scorer does not report it), and where the scorer
    has a result for turn ``k``. Raises :class:`ValueError` naming the row when a row
    has no results of ``scorer`` at all (a wrong scorer name must not pass silently)."""
    n = batch.batch_size
    num_turns = int(batch.turn_index.max().item()) + 1 if batch.turn_index.numel() else 0
    flags = np.zeros((n, num_turns), dtype=bool)
    present = np.zeros((n, num_turns), dtype=bool)
    for b, by_scorer in enumerate(batch.turn_results):
        results = by_scorer.get(scorer)
        if results is None:
            raise ShapingInputError(
                f"row {b} (session {batch.session_ids[b]!r}) has no per-turn results of scorer {scorer!r} "
                f"(it has {sorted(by_scorer) or 'none'})"
            )
        for k, tr in enumerate(results[:num_turns]):
            value = next((o.value for o in tr.observations if o.metric_id == metric), default)
            flags[b, k] = bool(value)
            present[b, k] = True
    device = batch.turn_index.device
    return torch.from_numpy(flags).to(device), torch.from_numpy(present).to(device)


def unhinted_turns(batch: TrainingBatch, opd_scorer: str = OPD_SCORER) -> Tensor:
    """``[B, K]`` bool: turns OpenClaw-RL's OPD would not train — the OPD scorer reports no
    accepted hint (``hint_accepted`` false: no hint, or no next state) or a failed judge /
    teacher (``judge_failed`` true, under ``on_all_votes_failed: neutral``)."""
    accepted, present = turn_flag_table(batch, opd_scorer, "hint_accepted", default=True)
    failed, _ = turn_flag_table(batch, opd_scorer, "judge_failed", default=False)
    return present & (~accepted | failed)


def streaming_turn_keep(turn_scores: Tensor, has_next_state: Tensor, judged: Tensor, sessions: Tensor) -> Tensor:
    """``[B, K]`` bool: the turns OpenClaw-RL's RL recipe trains on, per row.

    OpenClaw-RL decides each turn as its judge finishes, in turn order: a turn is
    excluded when it has no next state or scored ``0``, unless it has a next state and
    the session has *no included sample so far*. Walking turns in order, nothing is
    included before the first turn with a next state, so that turn is always kept
    (effective or rescued) and every later one only if effective — even when a later
    turn is effective, a leading neutral turn stays in (unlike :func:`exclude_neutral_turns`).
    Rows of one session (branches) share their first candidate turn number. The row's
    last judged turn is dropped (at the end of a session OpenClaw-RL submits it with an
    all-zero loss mask, or not at all).
    """
    if (
        turn_scores.dim() != 2
        or tuple(has_next_state.shape) != tuple(turn_scores.shape)
        or tuple(judged.shape) != tuple(turn_scores.shape)
    ):
        raise ShapingInputError(
            f"turn_scores, has_next_state and judged must be [B, K] of one shape; got {tuple(turn_scores.shape)}, "
            f"{tuple(has_next_state.shape)}, {tuple(judged.shape)}"
        )
    b, num_turns = turn_scores.shape
    if tuple(sessions.shape) != (b,):
        raise ShapingInputError(f"sessions must be [B] = [{b}], got {tuple(sessions.shape)}")
    if b == 0 or num_turns == 0:
        return torch.zeros_like(judged, dtype=torch.bool)
    device = turn_scores.device
    judged = judged.to(torch.bool)
    candidate = judged & has_next_state.to(torch.bool)
    order = torch.arange(num_turns, device=device).expand(b, num_turns)
    row_first = torch.where(candidate, order, torch.full_like(order, num_turns)).amin(dim=1)  # [B]
    sessions = sessions.to(device=device, dtype=torch.long)
    n_sessions = int(sessions.max().item()) + 1
    first = torch.full((n_sessions,), num_turns, dtype=torch.long, device=device).scatter_reduce(
        0, sessions, row_first, reduce="amin", include_self=True
    )
    rescued = order == first[sessions].unsqueeze(1)
    last = torch.where(judged, order, torch.full_like(order, -1)).amax(dim=1, keepdim=True)  # [B, 1]
    return candidate & ((turn_scores != 0) | rescued) & (order != last)
