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

:class:`VerdictMetrics` is the trainer-side aggregator built on :func:`merge_stats`: it
folds the ``stats`` of every scored session of every verdict it sees into one view
and adds the pipeline's own counters (verdicts by status and reason, duplicates,
dropped groups, filter decisions) under :data:`PIPELINE_PREFIX`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final
from urllib.parse import quote

if TYPE_CHECKING:
    from infra.schema import GroupVerdict
    from shaper.filters import FilterDecision

__all__ = ["COUNT_SUFFIX", "PIPELINE_PREFIX", "VerdictMetrics", "count_key", "merge_stats", "reason_code"]

log = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------- verdicts
PIPELINE_PREFIX: Final[str] = "pipeline"
"""Namespace of the trainer-side counters (all plain counts: added when merged)."""


def reason_code(reason: str) -> str:
    """``"missing_sessions: 1 of 2 arrived"`` -> ``"missing_sessions"``, safe as a key part.

    Verdict reasons start with a stable code followed by free text; only the code
    may become part of a metric name, or every distinct message would be a new series.
    """
    code = (reason or "unspecified").split(":", 1)[0].strip()[:64] or "unspecified"
    return quote(code, safe="-_.")


class VerdictMetrics:
    """Count-weighted scoring metrics plus pipeline counters, per window and in total.

    What counts (seed 001, "v2 Export And Metric Transport"):

    * the ``stats`` of every member with status ``scored``, whatever the verdict's
      status — "each successfully scored session contributes observations even if
      another member rejects the group". Failed members publish no partial
      observations, so their ``stats`` are ignored even if present; discarded members
      were never scored. These are *scoring* metrics, not counts of samples the
      optimizer used.
    * ``pipeline/verdicts/<status>`` per distinct verdict observed, and
      ``pipeline/verdicts/<status>/<reason code>`` for rejected and discarded ones;
    * whatever the caller counts with :meth:`count` (``pipeline/<name>``) and the
      filter decisions of :meth:`record_filter` (``pipeline/filter/<counter>``, the
      fields of :class:`shaper.filters.FilterCounters`).

    :meth:`drain` returns the merged view since the previous drain (what a
    :class:`~shaper.batch.TrainingBatch` carries), :meth:`totals` everything since
    construction. Since every counter is a plain count and every mean carries its
    ``__count``, windows merge back into totals with :func:`merge_stats`.
    """

    def __init__(self) -> None:
        from shaper.filters import FilterCounters  # torch-backed module; keep merge_stats light

        self._counters_type = FilterCounters
        self._window: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self._window_filters = FilterCounters()
        self._total_filters = FilterCounters()

    # ------------------------------------------------------------------ recording
    def observe(self, verdict: GroupVerdict) -> None:
        """Record one distinct verdict: its status counters and its scored members' stats.

        A member whose stats :func:`merge_stats` refuses (non-finite, mean without
        count) is skipped and counted as ``pipeline/stats_invalid`` instead of
        failing the trainer over a monitoring value.
        """
        self.count(f"verdicts/{verdict.status}")
        if verdict.status != "accepted":
            self.count(f"verdicts/{verdict.status}/{reason_code(verdict.reason)}")
        for session in verdict.sessions:
            if session.status != "scored" or not session.stats:
                continue
            try:
                window = merge_stats([self._window, session.stats])
                total = merge_stats([self._total, session.stats])
            except ValueError as exc:
                log.warning("group %s session %s: ignoring invalid stats: %s",
                            verdict.group_id, session.session_id, exc)
                self.count("stats_invalid")
                continue
            self._window, self._total = window, total

    def count(self, name: str, n: float = 1.0) -> None:
        """Add ``n`` to the counter ``pipeline/<name>``."""
        key = f"{PIPELINE_PREFIX}/{name}"
        for target in (self._window, self._total):
            target[key] = target.get(key, 0.0) + float(n)

    def record_filter(self, decision: FilterDecision) -> None:
        """Count one group-filter decision by reason (see :class:`shaper.filters.FilterCounters`)."""
        self._window_filters.record(decision)
        self._total_filters.record(decision)

    # ------------------------------------------------------------------ reading
    def _view(self, stats: dict[str, float], filters: object) -> dict[str, float]:
        out = dict(stats)
        for name, value in filters.as_dict().items():  # type: ignore[attr-defined]
            if value:
                out[f"{PIPELINE_PREFIX}/filter/{name}"] = float(value)
        return out

    def peek(self) -> dict[str, float]:
        """The current window, without resetting it."""
        return self._view(self._window, self._window_filters)

    def drain(self) -> dict[str, float]:
        """The current window (merged since the previous drain), then start a new one."""
        out = self.peek()
        self._window = {}
        self._window_filters = self._counters_type()
        return out

    def totals(self) -> dict[str, float]:
        """Everything recorded since construction."""
        return self._view(self._total, self._total_filters)
