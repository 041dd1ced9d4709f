"""Grouped rollout filters: decide whether a complete sample group is worth training on.

GRPO learns only from *differences* inside a group.  A group whose members all
earned the same outcome reward has zero outcome advantage everywhere, so it is
usually dropped.  With process rewards one such case is still useful: an
all-wrong group in which the scorers flagged specific bad steps (negative token
rewards) still tells the policy *where* it went wrong (see ``gvpo`` shaping).

Both filters here follow seed 001 ("Branches, Filtering And Metrics"):

* keep mixed-outcome groups (not every outcome reward equal);
* keep all-wrong groups (every reward equal and ``<= 0``) that have at least one
  negative process reward at a valid (``loss_mask``) position;
* reject all-correct groups (every reward equal and ``> 0``) and all-wrong
  groups without any such penalty.

The ``_mask_no_eos`` variant mirrors an actor that zeroes the loss of truncated
sequences (``mask_no_eos_with_zero``): a penalty inside a sequence the actor
will not train on cannot justify keeping the group, so truncated rows are
ignored when looking for penalties.

Filters must see *complete* groups; deciding on a partial group would judge
"mixed" or "all-wrong" on samples that are not all there.  Token rewards are
examined *unshifted* (aligned with the generated tokens and ``loss_mask``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Final

import torch
from torch import Tensor

__all__ = [
    "FILTERS",
    "FilterCounters",
    "FilterDecision",
    "GroupFilter",
    "REASONS",
    "filter_mixed_or_penalized_all_wrong",
    "filter_mixed_or_penalized_all_wrong_mask_no_eos",
    "get_filter",
]

REASONS: Final[tuple[str, ...]] = ("mixed", "penalized_all_wrong", "all_correct", "all_wrong")
"""Every ``FilterDecision.reason`` a filter in this module can produce."""


@dataclass(frozen=True, slots=True)
class FilterDecision:
    """Outcome of a group filter.

    ``reason`` is kept next to ``keep`` so that rejections can be counted by
    cause (:class:`FilterCounters`); ``bool(decision)`` is ``keep`` so callers
    that only care about the verdict can write ``if flt(group): ...``.
    """

    keep: bool
    reason: str

    def __bool__(self) -> bool:
        return self.keep


GroupFilter = Callable[[Mapping[str, Tensor]], FilterDecision]


# --------------------------------------------------------------------------- #
# Input validation
# --------------------------------------------------------------------------- #
def _outcome_rewards(group: Mapping[str, Tensor]) -> Tensor:
    """``original_rewards`` (before any group normalisation) win over ``rewards``.

    Once rewards are normalised a group's values are centred, so "all > 0"
    no longer means "all correct"; the raw outcome is what the rule is about.
    """
    key = "original_rewards" if "original_rewards" in group else "rewards"
    if key not in group or group[key] is None:
        raise ValueError("group has neither 'original_rewards' nor 'rewards'")
    rewards = torch.as_tensor(group[key])
    if rewards.dim() != 1:
        raise ValueError(f"group[{key!r}] must be 1-D [G]; got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError(f"group[{key!r}] is empty; filters need a complete, non-empty group")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"group[{key!r}] contains non-finite values: {rewards.tolist()}")
    return rewards


def _token_tensor(group: Mapping[str, Tensor], key: str, num_rows: int) -> Tensor | None:
    value = group.get(key)
    if value is None:
        return None
    value = torch.as_tensor(value)
    if value.dim() != 2 or value.shape[0] != num_rows:
        raise ValueError(
            f"group[{key!r}] must have shape [G={num_rows}, T]; got {tuple(value.shape)}"
        )
    return value


def _penalty_positions(group: Mapping[str, Tensor], num_rows: int) -> Tensor | None:
    """``[G, T]`` bool: negative token reward at a valid position (None: no token rewards)."""
    token_rewards = _token_tensor(group, "token_rewards", num_rows)
    if token_rewards is None:
        return None
    penalised = token_rewards < 0
    loss_mask = _token_tensor(group, "loss_mask", num_rows)
    if loss_mask is not None:
        if loss_mask.shape != token_rewards.shape:
            raise ValueError(
                "group['loss_mask'] and group['token_rewards'] must have the same shape; got "
                f"{tuple(loss_mask.shape)} and {tuple(token_rewards.shape)}"
            )
        penalised = penalised & (loss_mask.to(penalised.device) != 0)
    return penalised


def _truncated_rows(group: Mapping[str, Tensor], num_rows: int) -> Tensor:
    """``[G]`` bool: rows that ended without EOS.

    ``is_truncated`` is authoritative.  Without it, a row whose attention
    length fills the whole padded width ``T`` is taken as truncated: it hit
    the length limit, so we cannot tell that it finished.
    """
    flags = group.get("is_truncated")
    if flags is not None:
        flags = torch.as_tensor(flags)
        if flags.dim() != 1 or flags.shape[0] != num_rows:
            raise ValueError(
                f"group['is_truncated'] must have shape [G={num_rows}]; got {tuple(flags.shape)}"
            )
        return flags != 0
    attention = _token_tensor(group, "attention_mask", num_rows)
    if attention is None:
        raise ValueError(
            "the _mask_no_eos filter needs 'attention_mask' [G, T] (or 'is_truncated' [G]) "
            "to tell which sequences were truncated"
        )
    return (attention != 0).sum(dim=-1) == attention.shape[-1]


# --------------------------------------------------------------------------- #
# Filters
# --------------------------------------------------------------------------- #
def _decide(rewards: Tensor, penalised: Tensor | None) -> FilterDecision:
    if bool((rewards != rewards[0]).any()):
        return FilterDecision(True, "mixed")
    if float(rewards[0]) > 0:
        return FilterDecision(False, "all_correct")
    if penalised is not None and bool(penalised.any()):
        return FilterDecision(True, "penalized_all_wrong")
    return FilterDecision(False, "all_wrong")


def filter_mixed_or_penalized_all_wrong(group: Mapping[str, Tensor]) -> FilterDecision:
    """Keep mixed groups and all-wrong groups that carry a process penalty.

    ``group`` holds one complete sample group: ``original_rewards`` (preferred)
    or ``rewards`` ``[G]``; optionally ``token_rewards`` and ``loss_mask``
    ``[G, T]`` (unshifted).  Without ``loss_mask`` every token position counts
    as valid; without ``token_rewards`` an all-wrong group has no penalty.

    Raises:
        ValueError: rewards missing, empty, non-finite or mis-shaped.
    """
    rewards = _outcome_rewards(group)
    return _decide(rewards, _penalty_positions(group, rewards.shape[0]))


def filter_mixed_or_penalized_all_wrong_mask_no_eos(group: Mapping[str, Tensor]) -> FilterDecision:
    """As :func:`filter_mixed_or_penalized_all_wrong`, ignoring penalties in truncated rows.

    Truncation comes from ``is_truncated`` ``[G]`` when present, else from
    ``attention_mask`` ``[G, T]`` (attention length == ``T`` means truncated).
    Outcome classification (mixed / all-correct / all-wrong) still uses every
    row: truncation changes which tokens train, not what the group scored.
    """
    rewards = _outcome_rewards(group)
    num_rows = rewards.shape[0]
    penalised = _penalty_positions(group, num_rows)
    if penalised is not None:
        truncated = _truncated_rows(group, num_rows).to(penalised.device)
        penalised = penalised & ~truncated.unsqueeze(-1)
    return _decide(rewards, penalised)


FILTERS: Final[dict[str, GroupFilter]] = {
    "filter_mixed_or_penalized_all_wrong": filter_mixed_or_penalized_all_wrong,
    "filter_mixed_or_penalized_all_wrong_mask_no_eos": filter_mixed_or_penalized_all_wrong_mask_no_eos,
}
"""Filters by configuration name."""


def get_filter(name: str) -> GroupFilter:
    """Look a filter up by its configuration name, failing loudly on typos."""
    try:
        return FILTERS[name]
    except KeyError:
        raise ValueError(
            f"unknown group filter {name!r}; valid names: {', '.join(sorted(FILTERS))}"
        ) from None


# --------------------------------------------------------------------------- #
# Counters
# --------------------------------------------------------------------------- #
@dataclass(slots=True)
class FilterCounters:
    """Running totals of filter decisions by reason, for trainer metrics.

    Plain integers (not tensors) so they merge with :func:`shaper.metrics.merge_stats`
    as counts: added across workers and steps.
    """

    rejected_by_all_correct: int = 0
    rejected_by_all_wrong: int = 0
    accepted_penalized_all_wrong: int = 0
    accepted_mixed: int = 0

    def record(self, decision: FilterDecision) -> None:
        """Count one decision; an unknown reason is a programming error and raises."""
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
