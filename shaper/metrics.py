"""Merging per-worker scoring statistics into one trainer-side view.

Scoring workers report small flat dicts of numbers.  Averaging their *means*
naively would give a worker that saw 1 observation the same say as one that
saw 10 000, so every mean or rate travels with its observation count under the
companion key ``"<key>__count"`` (seed 001: "Worker means and rates are
weighted by observation counts, while counts and sums are added").

Conventions, by key:

* ``K`` with a companion ``K__count`` anywhere in the input is a **mean or
  rate**: merged as ``sum(v_i * n_i) / sum(n_i)``; ``K__count`` in the output
  is the total count.  If that total is ``0`` the mean is undefined and ``K``
  is **omitted** (a fabricated ``0.0`` would look like a real measurement),
  while ``K__count = 0`` is kept so the absence is visible.
* every other key is a **count or sum** and is added.

This is pure Python on purpose: the dicts are tiny and live on the host.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Final

__all__ = ["COUNT_SUFFIX", "count_key", "merge_stats"]

COUNT_SUFFIX: Final[str] = "__count"
"""Suffix marking the observation count that weights a mean or rate."""


def count_key(key: str) -> str:
    """Name of the companion count key for mean/rate ``key``."""
    return key + COUNT_SUFFIX


def _as_number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"stat {key!r} must be a real number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"stat {key!r} is not finite: {value!r}")
    return number


def merge_stats(stats_list: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Merge per-worker stats dicts (see the module docstring for the rules).

    Example: ``[{"m": 1.0, "m__count": 1}, {"m": 0.0, "m__count": 3}]``
    merges to ``{"m": 0.25, "m__count": 4.0}``.

    Output keys keep first-seen order; values are floats.

    Raises:
        ValueError: a non-finite or non-numeric value, a negative count, or a
            mean reported without its count in some dict while another dict
            gives it one (its weight would be unknown).
    """
    dicts = [dict(stats) for stats in stats_list]
    for stats in dicts:
        for key, value in stats.items():
            _as_number(key, value)

    mean_keys = {
        key[: -len(COUNT_SUFFIX)]
        for stats in dicts
        for key in stats
        if key.endswith(COUNT_SUFFIX) and len(key) > len(COUNT_SUFFIX)
    }

    order: dict[str, None] = {}
    totals: dict[str, float] = {}
    weighted: dict[str, float] = {}
    for stats in dicts:
        for key, raw in stats.items():
            order.setdefault(key, None)
            value = float(raw)
            if key in mean_keys:
                if count_key(key) not in stats:
                    raise ValueError(
                        f"mean/rate {key!r} is reported without {count_key(key)!r} in one of "
                        "the stats dicts, so it cannot be weighted"
                    )
                weighted[key] = weighted.get(key, 0.0) + value * float(stats[count_key(key)])
            else:
                if key.endswith(COUNT_SUFFIX) and key[: -len(COUNT_SUFFIX)] in mean_keys and value < 0:
                    raise ValueError(f"count {key!r} must be >= 0, got {raw!r}")
                totals[key] = totals.get(key, 0.0) + value

    merged: dict[str, float] = {}
    for key in order:
        if key in mean_keys:
            total = totals.get(count_key(key), 0.0)
            if total > 0:
                merged[key] = weighted.get(key, 0.0) / total
        else:
            merged[key] = totals[key]
    return merged
