"""Merging per-worker scoring statistics into one trainer-side view.

Scoring workers report small flat dicts of numbers.  Averaging their *means*
naively would give a worker that saw 1 observation the same say as one that
saw 10 000, so every mean or rate travels with its observation count under the
companion key ``"<key>__count"`` (AReaL's Process Rewards: "Worker means and rates are
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

from infra import reasons

if TYPE_CHECKING:
    from infra.schema import GroupVerdict
    from shaper.filters import FilterDecision

__all__ = [
    "COUNT_SUFFIX",
    "PIPELINE_PREFIX",
    "VerdictMetrics",
    "count_key",
    "merge_stats",
    "merge_worker_stats",
    "reason_key",
]

log = logging.getLogger(__name__)

COUNT_SUFFIX: Final[str] = "__count"
"""Suffix marking the observation count that weights a mean or rate."""


def count_key(key: str) -> str:
    """Name of the companion count key for mean/rate ``key``."""
    return key + COUNT_SUFFIX


def merge_stats(stats_list: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Merge per-worker stats dicts (see the module docstring for the rules).

    Example: ``[{"m": 1.0, "m__count": 1}, {"m": 0.0, "m__count": 3}]``
    merges to ``{"m": 0.25, "m__count": 4.0}``.

    Edge cases as AReaL's merge: a mean is weighted only by the count **in its own
    dict**, so a mean reported without its count carries no weight and is dropped;
    values are not validated (a NaN mean makes the merged mean NaN). Unlike AReaL's
    :func:`merge_worker_stats` it keeps ``__count`` keys and non-PRM keys, so merged
    windows can be merged again (the trainer's :class:`VerdictMetrics`). Output keys
    keep first-seen order; values are floats.
    """
    dicts = [dict(stats) for stats in stats_list]
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
            if key in mean_keys:
                count = stats.get(count_key(key))
                if count is None:
                    continue  # no weight: AReaL drops it
                order.setdefault(key, None)
                weighted[key] = weighted.get(key, 0.0) + float(raw) * float(count)
            else:
                order.setdefault(key, None)
                totals[key] = totals.get(key, 0.0) + float(raw)
    merged: dict[str, float] = {}
    for key in order:
        if key in mean_keys:
            total = totals.get(count_key(key), 0.0)
            if total > 0:
                merged[key] = weighted.get(key, 0.0) / total
        else:
            merged[key] = totals[key]
    return merged


_SUM_AGGREGATIONS: Final[frozenset[str]] = frozenset({"count", "sum", "observed_count"})


def merge_worker_stats(stats_list: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """AReaL's ``_merge_worker_stats`` (rollout controller), rule for rule.

    1. keys ending ``__count`` are never output;
    2. ``K`` with ``K__count`` in the same dict: ``sum(v*c) / sum(c)``, omitted unless
       ``sum(c) > 0``;
    3. otherwise keep (summed, under the key as given, namespace included) only keys
       that, after stripping a leading ``rollout/`` then ``eval-rollout/``, read
       ``prm_metric/{turn|trajectory}/<scorer>/<metric>/{count|sum|observed_count}``;
    4. everything else is dropped. No value validation. Output: sums, then means.
    """
    sums: dict[str, float] = {}
    weighted: dict[str, float] = {}
    counts: dict[str, float] = {}
    for stats in stats_list:
        for key, value in stats.items():
            if key.endswith(COUNT_SUFFIX):
                continue
            count = stats.get(count_key(key))
            if count is not None:
                weighted[key] = weighted.get(key, 0.0) + value * count
                counts[key] = counts.get(key, 0.0) + count
                continue
            name = key.removeprefix("rollout/").removeprefix("eval-rollout/")
            parts = name.split("/")
            if (
                len(parts) == 5
                and parts[0] == "prm_metric"
                and parts[1] in ("turn", "trajectory")
                and parts[4] in _SUM_AGGREGATIONS
            ):
                sums[key] = sums.get(key, 0.0) + value  # the prefix is stripped only to classify
    means = {key: weighted[key] / counts[key] for key in weighted if counts[key] > 0}
    return {**sums, **means}


# --------------------------------------------------------------------------- verdicts
PIPELINE_PREFIX: Final[str] = "pipeline"
"""Namespace of the trainer-side counters (all plain counts: added when merged)."""


def reason_key(verdict: GroupVerdict) -> str:
    """The key part for a rejected or discarded verdict: its ``reason_code``, bounded.

    Only a registered code may become part of a metric name (:func:`infra.reasons.metric_label`:
    ``unspecified`` when a verdict carries none, ``other`` for a code this process does
    not know); the free-text ``reason`` never does, or every distinct message would be a
    new series.
    """
    return reasons.metric_label(verdict.status, verdict.reason_code)


class VerdictMetrics:
    """Count-weighted scoring metrics plus pipeline counters, per window and in total.

    What counts (AReaL's Process Rewards, "v2 Export And Metric Transport"):

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

        A member whose stats are non-finite or non-numeric is skipped and counted as ``pipeline/stats_invalid``
        instead of failing the
        trainer over a monitoring value.
        """
        self.count(f"verdicts/{verdict.status}")
        if verdict.status != "accepted":
            self.count(f"verdicts/{verdict.status}/{reason_key(verdict)}")
        for session in verdict.sessions:
            if session.status != "scored" or not session.stats:
                continue
            try:
                # Ours, not AReaL's merge: one NaN would poison the running totals forever.
                bad = [k for k, v in session.stats.items() if not math.isfinite(v)]
                if bad:
                    raise ValueError(f"non-finite stats {bad}")
                window = merge_stats([self._window, session.stats])
                total = merge_stats([self._total, session.stats])
            except (ValueError, TypeError) as exc:
                log.warning(
                    "group %s session %s: ignoring invalid stats: %s", verdict.group_id, session.session_id, exc
                )
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
