r"""Concat export: accepted verdicts -> padded training tensors.

Long on purpose: the concat rebuild, padding and reward alignment are one invariant (rewards on the right tokens).

A :class:`~infra.schema.GroupVerdict` is self-contained: every scored member carries its
token tree (compact :class:`~infra.schema.TokenTurn`\ s: each turn's *new* prompt tokens
and its output) and, per root-to-leaf branch, the per-token process rewards of each
turn. The trainer needs the *concat* view of that (AReaL's Process Rewards: scorers require
``export_style: concat``): one row per branch holding the leaf turn's full sequence —
its input tokens followed by its output tokens, which is the concatenation of
``prompt_delta + output`` over the path. Turn ``k``'s output therefore sits at
``[len(input_k), len(input_k) + output_len_k)`` of that sequence; those positions form
the ``loss_mask`` and receive the branch's token rewards and the turn's log-probs.
Everything else (the prompt, tool results, padding) is zero and masked out.

The construction is split in two so that the consumer can filter *complete groups*
before batching (filters judge complete sample groups):

* :func:`export_group` validates one accepted verdict and builds its rows as unpadded
  numpy arrays (:class:`ExportedGroup`); the group filters of :mod:`shaper.filters`
  read that group directly (it is also the mapping of ``[G, T]`` tensors a custom
  filter may index, laid out on demand);
* :func:`collate` pads the kept groups into one :class:`TrainingBatch`, once.

:func:`build_training_batch` does both for callers that hold verdicts already (replay
tools, tests). Work is per turn (numpy concatenation and slice assignment), never per
token in Python.

Two optional per-row extras travel along for trainer-side options:

* ``channels`` — each scorer's own weighted token rewards laid out like
  ``token_rewards`` (present when the workers ran with ``worker.keep_scorer_channels``),
  for :mod:`shaper.combined`;
* ``turn_results`` — the branch's typed per-turn results by scorer (path order), e.g.
  the judge's scores and ``has_next_state`` observations for :mod:`shaper.exclusion`.

Anything that cannot be laid out unambiguously is refused with
:class:`ConcatExportError` naming the group, session and turn — training on misaligned
tokens would silently attach rewards and log-probs to the wrong positions. The compact
form cannot express a turn whose input is not its parent's input + output; callers
holding full interactions convert with :func:`turns_from_interactions`, which applies
:func:`infra.schema.compact_turns`' prefix rule (the one the scoring workers apply).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import numpy as np
import torch
from torch import Tensor

from infra.config import ConfigError
from infra.errors import TrainingError
from infra.schema import (
    BranchResult,
    GroupVerdict,
    Interaction,
    NotConcatExport,
    PRMTurnResult,
    SessionResult,
    TokenRewards,
    TokenTurn,
    compact_turns,
)
from infra.tree import TreeError, branches
from shaper.errors import ShapingInputError

__all__ = [
    "ConcatExportError",
    "ExportedGroup",
    "ExportedRow",
    "TRUNCATED_STOP_REASONS",
    "TrainingBatch",
    "build_training_batch",
    "collate",
    "export_group",
    "export_session",
    "resolve_device",
    "turns_from_interactions",
]

TRUNCATED_STOP_REASONS: Final[frozenset[str]] = frozenset({"length"})
"""Leaf ``stop_reason`` values that mean "cut off by the token limit, no EOS".

``"length"`` is the finish reason vLLM, SGLang and the OpenAI API report when
generation hit ``max_tokens``; it is what AReaL's ``mask_no_eos_with_zero`` and the
``_mask_no_eos`` filter care about. Only the *leaf* turn matters: an earlier turn that
was cut off was still followed by more context, so the row itself did not end early.
"""


class ConcatExportError(TrainingError, ValueError):
    """An accepted verdict cannot be laid out as concat rows.

    ``reason`` is a short stable code (``not_prefix``, ``not_token_backed``,
    ``bad_tree``, ``branch_mismatch``, ``reward_length``, ``channel_mismatch``,
    ``missing_outcome``, ``session_not_scored``, ``no_interactions``) used to count drops; the message says
    which group, session and turn, and what was wrong.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        group_id: str = "",
        session_id: str = "",
        interaction_id: str | None = None,
    ) -> None:
        where = f"group {group_id!r} session {session_id!r}"
        if interaction_id is not None:
            where += f" turn {interaction_id!r}"
        super().__init__(f"{where}: {message}")
        self.reason = reason
        self.group_id = group_id
        self.session_id = session_id
        self.interaction_id = interaction_id


# --------------------------------------------------------------------------- rows
@dataclass(frozen=True, slots=True)
class ExportedRow:
    """One root-to-leaf branch as unpadded arrays of the leaf's sequence length ``L``."""

    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # bool [L]
    logprobs: np.ndarray  # float32 [L]
    token_rewards: np.ndarray  # float32 [L]
    turn_index: np.ndarray  # int32 [L]: k on turn k's output tokens (root = 0), -1 elsewhere
    reward: float
    is_truncated: bool
    session_id: str
    trajectory_id: str
    leaf_id: str
    channels: Mapping[str, np.ndarray] = field(default_factory=dict)  # scorer -> float32 [L]
    turn_results: Mapping[str, tuple[PRMTurnResult, ...]] = field(default_factory=dict)  # scorer -> per turn

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class ExportedGroup(Mapping[str, Tensor]):
    """All rows of one accepted verdict (a complete GRPO group), ready to filter and batch.

    It is also the read-only mapping a group filter reads (:mod:`shaper.filters`):
    ``original_rewards`` ``[G]`` (raw outcomes, before any normalisation),
    ``token_rewards`` / ``loss_mask`` / ``attention_mask`` ``[G, T]`` (unshifted, padded
    within the group) and ``is_truncated`` ``[G]``. Each is laid out when asked for, so
    the built-in filters, which read :attr:`rows` directly, pad nothing; a batch is built
    once, by :func:`collate`, for the groups that are kept.
    """

    group_id: str
    verdict_version: int
    rows: tuple[ExportedRow, ...]
    is_eval: bool = False

    FILTER_KEYS: ClassVar[tuple[str, ...]] = (
        "original_rewards",
        "token_rewards",
        "loss_mask",
        "attention_mask",
        "is_truncated",
    )

    def __getitem__(self, key: str) -> Tensor:
        rows = self.rows
        if key == "original_rewards":
            return torch.tensor([row.reward for row in rows], dtype=torch.float32)
        if key == "is_truncated":
            return torch.tensor([row.is_truncated for row in rows], dtype=torch.bool)
        if key == "attention_mask":
            return torch.from_numpy(_pad(rows, None, np.bool_, True))
        if key in ("token_rewards", "loss_mask"):
            return torch.from_numpy(_pad(rows, key, np.float32 if key == "token_rewards" else np.bool_))
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.FILTER_KEYS)

    def __contains__(self, key: object) -> bool:
        return key in self.FILTER_KEYS

    def __len__(self) -> int:
        return len(self.FILTER_KEYS)

    def filter_inputs(self) -> dict[str, Tensor]:
        """Every filter tensor at once, as a plain dict (the mapping itself serves filters)."""
        return dict(self)


def turns_from_interactions(
    interactions: Sequence[Interaction], *, group_id: str = "", session_id: str = ""
) -> list[TokenTurn]:
    """Full token-backed interactions -> the verdicts' compact :class:`TokenTurn` form.

    For callers that hold whole trajectories (JSONL replay, a
    :class:`~infra.schema.ReadyTrajectory` scored in-process) rather than verdicts. The
    concat rule the compact form relies on — every turn's input starts with its parent's
    input + output — is :func:`infra.schema.compact_turns`' (the workers' own check); a
    turn that breaks it is a :class:`ConcatExportError` naming the turn and the first
    differing token.
    """
    try:
        return compact_turns(interactions)
    except TreeError as exc:
        raise ConcatExportError(
            f"interaction tree is invalid: {exc}", reason="bad_tree", group_id=group_id, session_id=session_id
        ) from None
    except NotConcatExport as exc:
        raise ConcatExportError(
            exc.detail, reason=exc.reason, group_id=group_id, session_id=session_id, interaction_id=exc.interaction_id
        ) from None


def _export_branch(
    path: Sequence[TokenTurn],
    rewards: Mapping[str, TokenRewards],
    session: SessionResult,
    group_id: str,
    outcome: float,
    channels: Mapping[str, Mapping[str, TokenRewards]] | None = None,
    turn_results: Mapping[str, tuple[PRMTurnResult, ...]] | None = None,
) -> ExportedRow:
    """Lay one root-to-leaf path out as the leaf's sequence.

    In the compact form turn ``k`` contributes ``prompt_delta_k`` then ``output_k``;
    the concatenation over the path is exactly the leaf's input + output, and turn
    ``k``'s output starts at ``len(input_k)`` = everything before it on the path.
    A scorer channel is laid out exactly like the summed rewards, and must cover every
    turn of the path (a channel with holes would read as real zeros).
    """
    sid = session.session_id
    pieces: list[np.ndarray] = []
    spans: list[tuple[TokenTurn, int, int]] = []
    pos = 0
    for t in path:
        delta, out = t.prompt_delta, t.output_tokens  # the schema's views: the shaper never reads wire bytes
        pieces += (delta, out)
        start = pos + delta.shape[0]
        pos = start + out.shape[0]
        spans.append((t, start, pos))
    ids = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int32)
    length = pos
    loss_mask = np.zeros(length, dtype=bool)
    logprobs = np.zeros(length, dtype=np.float32)
    token_rewards = np.zeros(length, dtype=np.float32)
    turn_index = np.full(length, -1, dtype=np.int32)
    for k, (t, start, stop) in enumerate(spans):
        loss_mask[start:stop] = True
        turn_index[start:stop] = k
        behaviour = t.output_logprobs
        if behaviour is not None:
            logprobs[start:stop] = behaviour
        tr = rewards.get(t.interaction_id)
        if tr is not None:
            if tr.length != stop - start:
                raise ConcatExportError(
                    f"token rewards have length {tr.length} but the turn generated {stop - start} tokens",
                    reason="reward_length",
                    group_id=group_id,
                    session_id=sid,
                    interaction_id=t.interaction_id,
                )
            token_rewards[start:stop] = tr.to_numpy()
    laid_out: dict[str, np.ndarray] = {}
    for scorer, turns in (channels or {}).items():
        values = np.zeros(length, dtype=np.float32)
        for t, start, stop in spans:
            tr = turns.get(t.interaction_id)
            if tr is None or tr.length != stop - start:
                raise ConcatExportError(
                    f"channel of scorer {scorer!r} has "
                    + ("no rewards" if tr is None else f"{tr.length} rewards")
                    + f" for a turn that generated {stop - start} tokens",
                    reason="channel_mismatch",
                    group_id=group_id,
                    session_id=sid,
                    interaction_id=t.interaction_id,
                )
            values[start:stop] = tr.to_numpy()
        laid_out[scorer] = values
    return ExportedRow(
        input_ids=ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        token_rewards=token_rewards,
        turn_index=turn_index,
        reward=outcome,
        is_truncated=path[-1].stop_reason in TRUNCATED_STOP_REASONS,
        session_id=sid,
        trajectory_id=session.trajectory_id,
        leaf_id=path[-1].interaction_id,
        channels=laid_out,
        turn_results=dict(turn_results or {}),
    )


def export_session(
    session: SessionResult, group_id: str = "", *, turns: Sequence[TokenTurn] | None = None
) -> list[ExportedRow]:
    """One row per branch of a scored member (``turns`` overrides ``session.turns``).

    Rows follow ``session.branches`` (the order the worker scored them); a session
    without branch results (scoring disabled) gets one row per tree leaf with zero
    process rewards. Every branch result must be a root-to-leaf path of the tree and
    every leaf must have one, or the rewards could not be placed unambiguously.
    """
    sid = session.session_id
    if session.status != "scored":
        raise ConcatExportError(
            f"is {session.status!r} inside an accepted verdict; every member must be scored",
            reason="session_not_scored",
            group_id=group_id,
            session_id=sid,
        )
    if session.outcome_reward is None:
        raise ConcatExportError("has no outcome_reward", reason="missing_outcome", group_id=group_id, session_id=sid)
    tree = list(session.turns if turns is None else turns)
    if not tree:
        raise ConcatExportError(
            "carries no turns to export", reason="no_interactions", group_id=group_id, session_id=sid
        )
    try:
        paths = branches(tree)
    except TreeError as exc:
        raise ConcatExportError(
            f"interaction tree is invalid: {exc}", reason="bad_tree", group_id=group_id, session_id=sid
        ) from None
    outcome = float(session.outcome_reward)
    if not session.branches:  # scoring disabled: every branch, no process rewards
        return [_export_branch(path, {}, session, group_id, outcome) for path in paths]
    by_leaf = {path[-1].interaction_id: path for path in paths}
    # Per-turn trainer options (shaper.exclusion) need each row's results by scorer; a
    # session whose results do not fit the layout gets none rather than a guess, and the
    # option that needs them says so.
    blocks = session.turn_result_blocks()
    rows: list[ExportedRow] = []
    seen: set[str] = set()
    for i, result in enumerate(session.branches):
        rows.append(
            _export_branch(
                _branch_path(result, by_leaf, seen, group_id, sid),
                result.token_rewards,
                session,
                group_id,
                outcome,
                result.channels,
                blocks[i] if blocks else None,
            )
        )
    missing = sorted(set(by_leaf) - seen)
    if missing:
        raise ConcatExportError(
            f"branch results cover leaves {sorted(seen)} but the tree also has leaves {missing}",
            reason="branch_mismatch",
            group_id=group_id,
            session_id=sid,
        )
    return rows


def _branch_path(
    result: BranchResult, by_leaf: Mapping[str, list[TokenTurn]], seen: set[str], group_id: str, sid: str
) -> list[TokenTurn]:
    """The tree's path to ``result.leaf_id``, after checking the scored path is that path."""
    path = by_leaf.get(result.leaf_id)
    if path is None or result.leaf_id in seen or [t.interaction_id for t in path] != list(result.path):
        raise ConcatExportError(
            f"branch result for leaf {result.leaf_id!r} (path {list(result.path)}) is not a "
            f"root-to-leaf path of the interaction tree, or is listed twice",
            reason="branch_mismatch",
            group_id=group_id,
            session_id=sid,
            interaction_id=result.leaf_id,
        )
    seen.add(result.leaf_id)
    return path


def export_group(verdict: GroupVerdict) -> ExportedGroup:
    """Validate an accepted verdict and lay out one row per branch of each member.

    Members come in verdict order (workers sort them by trajectory id), branches in
    the order the worker scored them. Raises :class:`ConcatExportError` for a
    trajectory the trainer cannot use, and :class:`ValueError` for a verdict that is
    not ``accepted`` (rejected and discarded groups are never trained on).
    """
    if verdict.status != "accepted":
        raise ShapingInputError(
            f"group {verdict.group_id!r}: only accepted verdicts become training rows, got "
            f"{verdict.status!r} (filter verdicts by status before exporting)"
        )
    rows: list[ExportedRow] = []
    for session in verdict.sessions:
        rows.extend(export_session(session, verdict.group_id))
    return ExportedGroup(
        group_id=verdict.group_id,
        verdict_version=verdict.verdict_version,
        rows=tuple(rows),
        is_eval=any(s.is_eval for s in verdict.sessions),
    )


# --------------------------------------------------------------------------- batch
@dataclass(slots=True)
class TrainingBatch:
    """A padded batch of concat rows (one per root-to-leaf branch), right-padded to ``T``.

    Token tensors are ``[B, T]`` and aligned to the *generated tokens* (unshifted):
    position ``t`` describes ``input_ids[:, t]``. PPO-style trainers shift
    ``token_rewards`` with :func:`shaper.shift_token_rewards` (and their masks and
    log-probs the same way) before shaping.

    * ``input_ids`` int64: the leaf turn's input followed by its output; padding is
      ``pad_token_id``.
    * ``attention_mask`` bool: real tokens.
    * ``loss_mask`` bool: exactly the output tokens of every turn on the branch.
    * ``logprobs`` float32: the behaviour policy's log-prob of each output token
      (``0`` elsewhere, and where the producer sent none).
    * ``token_rewards`` float32: the branch's weighted process reward per output
      token; ``0`` on prompt/tool/padding positions.
    * ``turn_index`` int64: ``k`` on the output tokens of the branch's ``k``-th turn
      (root = 0), ``-1`` elsewhere — what per-turn signals (e.g.
      :mod:`shaper.combined`) need to map turn scores onto tokens.
    * ``rewards`` float32 ``[B]``: raw outcome rewards, *before* group normalisation.
    * ``is_truncated`` bool ``[B]``: the leaf's ``stop_reason`` is ``"length"``
      (see :data:`TRUNCATED_STOP_REASONS`).
    * ``group_ids`` / ``session_ids`` / ``trajectory_ids`` / ``leaf_ids``: per row.
    * ``metrics``: merged scoring metrics and pipeline counters since the previous
      batch (:class:`shaper.metrics.VerdictMetrics`); plain floats.
    * ``channels``: scorer name -> float32 ``[B, T]``, that scorer's own weighted token
      rewards (unshifted, laid out like ``token_rewards``). Only scorers whose channel
      every row carries are present (workers with ``worker.keep_scorer_channels``): a
      zero-filled hole would be indistinguishable from a real zero signal.
    * ``turn_results``: per row, scorer name -> that scorer's
      :class:`~infra.schema.PRMTurnResult` for each turn ``k`` of the branch (empty
      when the verdict's results do not line up with its branches). Not tensors; see
      :func:`shaper.exclusion.judge_turn_table`.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    logprobs: Tensor
    token_rewards: Tensor
    turn_index: Tensor
    rewards: Tensor
    is_truncated: Tensor
    group_ids: list[str]
    session_ids: list[str]
    trajectory_ids: list[str] = field(default_factory=list)
    leaf_ids: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    channels: dict[str, Tensor] = field(default_factory=dict)
    turn_results: list[Mapping[str, tuple[PRMTurnResult, ...]]] = field(default_factory=list)

    _TENSORS: ClassVar[tuple[str, ...]] = (
        "input_ids",
        "attention_mask",
        "loss_mask",
        "logprobs",
        "token_rewards",
        "turn_index",
        "rewards",
        "is_truncated",
    )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_groups(self) -> int:
        return len(dict.fromkeys(self.group_ids))

    @property
    def num_tokens(self) -> int:
        """Trainable (loss-masked) tokens."""
        return int(self.loss_mask.sum().item())

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: str | torch.device, *, non_blocking: bool = False) -> TrainingBatch:
        """A copy with every tensor on ``device`` (lists and metrics are shared, not copied)."""
        moved: dict[str, Any] = {
            name: getattr(self, name).to(device, non_blocking=non_blocking) for name in self._TENSORS
        }
        moved["channels"] = {k: v.to(device, non_blocking=non_blocking) for k, v in self.channels.items()}
        return dataclasses.replace(self, **moved)


def _pad(
    rows: Sequence[ExportedRow], field: str | None, dtype: type, fill: Any = 0, width: int | None = None
) -> np.ndarray:
    """``[len(rows), width]`` of one row field, right-padded with ``fill`` (``field=None``: the
    attention mask, ``fill`` on each row's tokens). ``width`` defaults to the longest row."""
    width = max((row.length for row in rows), default=0) if width is None else width
    out: np.ndarray = np.full((len(rows), width), 0 if field is None else fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : row.length] = fill if field is None else getattr(row, field)
    return out


def collate(
    groups: Iterable[ExportedGroup],
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    metrics: Mapping[str, float] | None = None,
) -> TrainingBatch:
    """Right-pad the rows of ``groups`` into one CPU :class:`TrainingBatch`.

    ``pad_to_multiple_of`` rounds ``T`` up (e.g. 8 or 64 for tensor-core friendly
    shapes). Padding happens in numpy and the tensors share its memory (no copy).
    """
    rows: list[ExportedRow] = []
    group_ids: list[str] = []
    for group in groups:
        rows.extend(group.rows)
        group_ids.extend([group.group_id] * len(group.rows))
    width = max((row.length for row in rows), default=0)
    if pad_to_multiple_of and pad_to_multiple_of > 1 and width % pad_to_multiple_of:
        width += pad_to_multiple_of - width % pad_to_multiple_of
    # A channel is batched only if every row has it (see TrainingBatch.channels).
    names = [name for name in (rows[0].channels if rows else {}) if all(name in r.channels for r in rows)]
    channels = {}
    for name in names:
        values = channels[name] = np.zeros((len(rows), width), dtype=np.float32)
        for i, row in enumerate(rows):
            values[i, : row.length] = row.channels[name]
    tensor = torch.from_numpy
    return TrainingBatch(
        input_ids=tensor(_pad(rows, "input_ids", np.int64, pad_token_id, width)),
        attention_mask=tensor(_pad(rows, None, np.bool_, True, width)),
        loss_mask=tensor(_pad(rows, "loss_mask", np.bool_, False, width)),
        logprobs=tensor(_pad(rows, "logprobs", np.float32, 0, width)),
        token_rewards=tensor(_pad(rows, "token_rewards", np.float32, 0, width)),
        turn_index=tensor(_pad(rows, "turn_index", np.int64, -1, width)),
        rewards=torch.tensor([row.reward for row in rows], dtype=torch.float32),
        is_truncated=torch.tensor([row.is_truncated for row in rows], dtype=torch.bool),
        group_ids=group_ids,
        session_ids=[row.session_id for row in rows],
        trajectory_ids=[row.trajectory_id for row in rows],
        leaf_ids=[row.leaf_id for row in rows],
        metrics=dict(metrics or {}),
        channels={name: tensor(values) for name, values in channels.items()},
        turn_results=[row.turn_results for row in rows],
    )


def build_training_batch(
    verdicts: Iterable[GroupVerdict],
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    metrics: Mapping[str, float] | None = None,
) -> TrainingBatch:
    """Export and collate accepted verdicts (no filtering, no dedupe: the consumer's job).

    Raises :class:`ConcatExportError` for a trajectory that breaks the concat layout and
    :class:`ValueError` for a verdict that is not accepted.
    """
    return collate(
        [export_group(v) for v in verdicts],
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        metrics=metrics,
    )


def resolve_device(name: str | torch.device | None) -> torch.device:
    """``auto`` (or None) -> ``cuda`` when available, else ``cpu``; anything else as given.

    Asking for ``cuda`` on a machine without it fails here with a clear message instead
    of deep inside the first ``.to()``.
    """
    if name is None or (isinstance(name, str) and name == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but torch.cuda.is_available() is False; use --device cpu or auto")
    return device
