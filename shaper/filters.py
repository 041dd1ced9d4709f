"""Grouped rollout filters: decide whether a complete sample group is worth training on.

GRPO learns only from *differences* inside a group.  A group whose members all
earned the same outcome reward has zero outcome advantage everywhere, so it is
usually dropped.  With process rewards one such case is still useful: an
all-wrong group in which the scorers flagged specific bad steps (negative token
rewards) still tells the policy *where* it went wrong (see ``gvpo`` shaping).

The filters follow AReaL's ``examples.swe.filter_function`` exactly:

* :func:`filter_mixed_or_penalized_all_wrong` (and its ``_mask_no_eos`` variant)
  return a plain ``bool``: keep mixed-outcome groups, and all-wrong groups (every
  reward equal and ``<= 0``) with a negative token reward at a valid position;
  :func:`filter_function` keeps mixed groups only. Each call records AReaL's
  per-call scalars into a :class:`ScalarTracker` (``rollout`` by default:
  :data:`ROLLOUT_TRACKER`), exported as fractions of calls.
* :func:`decide_mixed_or_penalized_all_wrong` (and ``_mask_no_eos``) are the same
  rules returning a :class:`FilterDecision` with the reason; the trainer's consumer
  uses these (:data:`FILTERS`, by AReaL's names) to count decisions by cause.

Edge inputs as AReaL: rewards are ``original_rewards`` if the key is present (even
when None, which is an error), else ``rewards``; any shape (flattened); empty or
non-finite is a ``ValueError``. Token tensors are looked at only for a uniform
all-wrong group: without ``token_rewards`` or ``loss_mask`` there is no penalty;
non-tensors, shapes that differ or are not 2-D, and non-finite token rewards are
``ValueError``. The ``_mask_no_eos`` variant, mirroring the actor's
``mask_no_eos_with_zero`` (which zeroes truncated rows' rewards), also needs
``attention_mask`` then (even with ``is_truncated``) and ignores penalties in
truncated rows; ``is_truncated`` wins over attention length == padded width.

Filters must see *complete* groups.  Token rewards are examined *unshifted*
(aligned with the generated tokens and ``loss_mask``). The trainer's consumer hands a
filter the exported group itself (:class:`shaper.batch.ExportedGroup`): these rules read
its rows as they are (each row's ``is_truncated`` is the leaf's), and a custom filter may
index it like the mapping above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import torch
from torch import Tensor

from infra.config import ConfigError
from shaper.errors import ShapingInputError

from .batch import ExportedGroup

__all__ = [
    "FILTERS",
    "FilterCounters",
    "FilterDecision",
    "GroupFilter",
    "REASONS",
    "ROLLOUT_TRACKER",
    "ScalarTracker",
    "decide_mixed_or_penalized_all_wrong",
    "decide_mixed_or_penalized_all_wrong_mask_no_eos",
    "filter_function",
    "filter_mixed_or_penalized_all_wrong",
    "filter_mixed_or_penalized_all_wrong_mask_no_eos",
    "get_filter",
]

REASONS: Final[tuple[str, ...]] = ("mixed", "penalized_all_wrong", "all_correct", "all_wrong")
"""Every ``FilterDecision.reason`` a filter in this module can produce."""


@dataclass(frozen=True, slots=True)
class FilterDecision:
    """Outcome of a group filter, with its cause (counted by :class:`FilterCounters`);
    ``bool(decision)`` is ``keep``."""

    keep: bool
    reason: str

    def __bool__(self) -> bool:
        return self.keep


GroupFilter = Callable[[Mapping[str, Any]], FilterDecision]


@dataclass(slots=True)
class ScalarTracker:
    """AReaL's ``stats_tracker`` scalars, in small: per-call values averaged on export.

    ``export()`` gives ``<scope>/<key>`` = mean over calls (a fraction for 0/1
    values) and ``<scope>/<key>__count`` = calls, so exports merge with
    :func:`shaper.metrics.merge_stats`.
    """

    scope: str = "rollout"
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def scalar(self, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.counts[key] = self.counts.get(key, 0) + 1

    def export(self, *, reset: bool = True) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, total in self.sums.items():
            n = self.counts[key]
            out[f"{self.scope}/{key}"] = total / n
            out[f"{self.scope}/{key}__count"] = float(n)
        if reset:
            self.sums.clear()
            self.counts.clear()
        return out


ROLLOUT_TRACKER: Final[ScalarTracker] = ScalarTracker("rollout")
"""Where the AReaL-named filters record by default (AReaL's ``rollout`` scope)."""


# --------------------------------------------------------------------------- #
# AReaL's rules
# --------------------------------------------------------------------------- #
def _outcome_rewards(sample: Mapping[str, Any]) -> Tensor:
    rewards = sample.get("original_rewards", sample.get("rewards"))
    if rewards is None:
        raise ShapingInputError("group filter needs 'original_rewards' or 'rewards' (got None)")
    r = (rewards if isinstance(rewards, Tensor) else torch.as_tensor(rewards)).flatten()
    if r.numel() == 0:
        raise ShapingInputError("group filter got empty rewards; filters need a complete, non-empty group")
    if not bool(torch.isfinite(r.float()).all()):
        raise ShapingInputError(f"group filter got non-finite rewards: {r.tolist()}")
    return r


def _tensor(sample: Mapping[str, Any], key: str) -> Tensor:
    value = sample[key]
    if not isinstance(value, Tensor):
        raise ShapingInputError(f"group[{key!r}] must be a tensor, got {type(value).__name__}")
    return value


def _truncated_rows(sample: Mapping[str, Any], mask: Tensor) -> Tensor:
    """``[B]`` bool, AReaL's truncation rule (``attention_mask`` required even with ``is_truncated``)."""
    if sample.get("attention_mask") is None:
        raise ShapingInputError("filter_mixed_or_penalized_all_wrong_mask_no_eos requires attention_mask")
    attention = _tensor(sample, "attention_mask")
    if attention.shape != mask.shape:
        raise ShapingInputError(
            f"group['attention_mask'] must have the loss_mask's shape {tuple(mask.shape)}; got {tuple(attention.shape)}"
        )
    flags = sample.get("is_truncated")
    if flags is not None:
        if not isinstance(flags, Tensor):
            raise TypeError(f"group['is_truncated'] must be a tensor, got {type(flags).__name__}")
        if tuple(flags.shape) != (mask.shape[0],):
            raise ShapingInputError(
                f"group['is_truncated'] must have shape [{mask.shape[0]}]; got {tuple(flags.shape)}"
            )
        return flags.bool()
    return (attention != 0).sum(dim=-1) == attention.shape[-1]


def _penalized_rows(group: ExportedGroup, *, mask_no_eos: bool) -> bool:
    """:func:`_penalized` on an exported group's unpadded rows (nothing is padded or batched)."""
    penalized = False
    for row in group.rows:
        if not np.isfinite(row.token_rewards).all():
            raise ShapingInputError("group['token_rewards'] contains non-finite values")
        if not (mask_no_eos and row.is_truncated):
            penalized = penalized or bool(((row.token_rewards < 0) & row.loss_mask).any())
    return penalized


def _penalized(sample: Mapping[str, Any], *, mask_no_eos: bool) -> bool:
    if isinstance(sample, ExportedGroup):
        return _penalized_rows(sample, mask_no_eos=mask_no_eos)
    if sample.get("token_rewards") is None or sample.get("loss_mask") is None:
        return False
    token_rewards, mask = _tensor(sample, "token_rewards"), _tensor(sample, "loss_mask")
    if token_rewards.shape != mask.shape or token_rewards.dim() != 2:
        raise ShapingInputError(
            "group['token_rewards'] and group['loss_mask'] must be 2-D with the same shape; got "
            f"{tuple(token_rewards.shape)} and {tuple(mask.shape)}"
        )
    if not bool(torch.isfinite(token_rewards).all()):
        raise ShapingInputError("group['token_rewards'] contains non-finite values")
    valid = mask != 0
    if mask_no_eos:
        valid = valid & ~_truncated_rows(sample, mask).to(valid.device).unsqueeze(-1)
    return bool(((token_rewards < 0) & valid).any())


def _decide(sample: Mapping[str, Any], *, mask_no_eos: bool) -> tuple[FilterDecision, Tensor]:
    r = _outcome_rewards(sample)
    mixed = bool((r != r[0]).any())
    all_wrong = bool((r <= 0).all())
    if mixed:
        return FilterDecision(True, "mixed"), r
    if not all_wrong:
        return FilterDecision(False, "all_correct"), r
    if _penalized(sample, mask_no_eos=mask_no_eos):
        return FilterDecision(True, "penalized_all_wrong"), r
    return FilterDecision(False, "all_wrong"), r


def _record(tracker: ScalarTracker, decision: FilterDecision, r: Tensor) -> None:
    reject = not decision.keep
    all_positive = bool((r > 0).all())
    tracker.scalar(
        rejected_by_failed_or_perfect=float(reject),
        rejected_by_all_correct=float(reject and all_positive),
        rejected_by_all_wrong=float(reject and not all_positive),
        accepted_penalized_all_wrong=float(decision.reason == "penalized_all_wrong"),
    )


def decide_mixed_or_penalized_all_wrong(sample: Mapping[str, Any]) -> FilterDecision:
    """AReaL's rule, as a :class:`FilterDecision` with the reason (records nothing)."""
    return _decide(sample, mask_no_eos=False)[0]


def decide_mixed_or_penalized_all_wrong_mask_no_eos(sample: Mapping[str, Any]) -> FilterDecision:
    """As :func:`decide_mixed_or_penalized_all_wrong`, ignoring penalties in truncated rows."""
    return _decide(sample, mask_no_eos=True)[0]


def filter_mixed_or_penalized_all_wrong(sample: Mapping[str, Any], tracker: ScalarTracker | None = None) -> bool:
    """AReaL's filter: keep mixed groups and penalized all-wrong groups; records its scalars."""
    decision, r = _decide(sample, mask_no_eos=False)
    _record(ROLLOUT_TRACKER if tracker is None else tracker, decision, r)
    return decision.keep


def filter_mixed_or_penalized_all_wrong_mask_no_eos(
    sample: Mapping[str, Any], tracker: ScalarTracker | None = None
) -> bool:
    """AReaL's ``_mask_no_eos`` filter: as above, penalties in truncated rows do not count."""
    decision, r = _decide(sample, mask_no_eos=True)
    _record(ROLLOUT_TRACKER if tracker is None else tracker, decision, r)
    return decision.keep


def filter_function(sample: Mapping[str, Any], tracker: ScalarTracker | None = None) -> bool:
    """AReaL's plain filter: keep mixed-outcome groups only ("all correct" = all ``>= 0.999``)."""
    r = _outcome_rewards(sample)
    accept = bool((r != r[0]).any())
    (ROLLOUT_TRACKER if tracker is None else tracker).scalar(
        rejected_by_failed_or_perfect=float(not accept),
        rejected_by_all_correct=float(not accept and bool((r >= 0.999).all())),
        rejected_by_all_wrong=float(not accept and not bool((r >= 0.999).all())),
    )
    return accept


FILTERS: Final[dict[str, GroupFilter]] = {
    "filter_mixed_or_penalized_all_wrong": decide_mixed_or_penalized_all_wrong,
    "filter_mixed_or_penalized_all_wrong_mask_no_eos": decide_mixed_or_penalized_all_wrong_mask_no_eos,
}
"""Configuration name (AReaL's) -> the rule returning a :class:`FilterDecision` (for the consumer)."""


def get_filter(name: str) -> GroupFilter:
    """Look a filter up by its configuration name, failing loudly on typos."""
    try:
        return FILTERS[name]
    except KeyError:
        raise ConfigError(f"unknown group filter {name!r}; valid names: {', '.join(sorted(FILTERS))}") from None


# --------------------------------------------------------------------------- #
# Counters
# --------------------------------------------------------------------------- #
@dataclass(slots=True)
class FilterCounters:
    """Running totals of filter decisions by reason, for trainer metrics.

    Plain integers (not tensors) so they merge with :func:`shaper.metrics.merge_stats`
    as counts: added across workers and steps.
    """

    rejected_by_failed_or_perfect: int = 0
    rejected_by_all_correct: int = 0
    rejected_by_all_wrong: int = 0
    accepted_penalized_all_wrong: int = 0
    accepted_mixed: int = 0

    def record(self, decision: FilterDecision) -> None:
        """Count one decision; an unknown reason is a programming error and raises.

        The first four counters are AReaL's (as counts, not per-call fractions);
        ``accepted_mixed`` is ours."""
        if decision.reason in ("all_correct", "all_wrong"):
            self.rejected_by_failed_or_perfect += 1
        if decision.reason == "mixed":
            self.accepted_mixed += 1
        elif decision.reason == "penalized_all_wrong":
            self.accepted_penalized_all_wrong += 1
        elif decision.reason == "all_correct":
            self.rejected_by_all_correct += 1
        elif decision.reason == "all_wrong":
            self.rejected_by_all_wrong += 1
        else:
            raise ValueError(f"unknown filter decision reason {decision.reason!r}; expected one of {REASONS}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
