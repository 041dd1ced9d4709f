"""What a scoring run produces: scored branches, their wire form and their metrics.

Metrics are returned as data (a flat ``dict[str, float]``) rather than pushed into a
recorder, because AReaL's rule is that a session's statistics are published only
when *every* branch succeeded — the caller decides, after the run, whether to record
them — and because the trainer merges many workers' dicts with
:func:`shaper.metrics.merge_stats`. The key conventions shared with that function:

* a mean or rate ``K`` is accompanied by ``K__count``, its number of observations,
  so workers' means are weighted by counts when merged;
* every other key is a plain count or sum and is added when merged.

Keys (``<ns>`` is ``rollout``, or ``eval-rollout`` for evaluation trajectories;
scorer and metric names are URL-quoted keeping ``-_.:``):

``<ns>/prm_turn_reward/<scorer>``
    mean of the scorer's weighted turn rewards over every turn of every branch
    (a turn shared by two branches counts once per branch); ``__count`` = turns.
``<ns>/prm_trajectory_reward/<scorer>``
    mean of the scorer's per-branch totals; ``__count`` = branches.
``<ns>/prm_metric/<scope>/<scorer>/<metric>/<aggregation>``
    structured, *unweighted* observations. Boolean ``count`` is the number of
    observations that were **true** (a plain count, added across workers) and
    ``rate`` the fraction true (with ``__count``); float ``sum`` is a plain sum and
    ``mean`` a mean (with ``__count``).
``<ns>/prm_metric/<scope>/<scorer>/<metric>/observed_count``
    the number of observations of that metric, emitted for every metric: the
    denominator that turns a ``count`` into a rate or a ``sum`` into a mean after
    merging.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

import numpy as np

from infra.errors import ScoringError
from infra.schema import BranchResult, PRMTurnResult, TokenRewards

if TYPE_CHECKING:
    import torch

__all__ = [
    "RunnerClosedError",
    "ScoredBranch",
    "ScoredTrajectory",
    "metric_name",
    "stats_namespace",
]

COUNT_SUFFIX = "__count"


class RunnerClosedError(ScoringError, RuntimeError):
    """``run()`` was called after ``aclose()`` started: a shutdown, not the trajectory's fault.

    A ``RuntimeError`` whose message contains "closed", as AReaL's."""


def stats_namespace(is_eval: bool) -> str:
    """``"eval-rollout"`` for evaluation trajectories, ``"rollout"`` otherwise (AReaL's Process Rewards)."""
    return "eval-rollout" if is_eval else "rollout"


def _q(name: str) -> str:
    return quote(name, safe="-_.:")


def metric_name(namespace: str, *parts: str) -> str:
    """Join a metric key; callers pass already-fixed parts (kind, scope, aggregation)."""
    return "/".join((namespace, *parts))


class ScoredBranch:
    """Scores of one root-to-leaf branch.

    ``token_rewards`` maps every interaction id on ``path`` to a float32 1-D tensor over
    that turn's output tokens: the weighted sum over scorers (zeros where no scorer
    ran). ``scorer_totals`` is each scorer's sum of turn rewards over the branch;
    ``turn_results`` are the typed per-(scorer, turn) results in config order.

    Turns that received only scalar contributions are kept as uniform
    :class:`~infra.schema.TokenRewards` and turned into tensors on first access of
    :attr:`token_rewards` (all at once, from one buffer). The worker only needs
    :meth:`to_branch_result`, which encodes uniform turns directly, so the common
    scalar-scorer path never allocates per-token tensors. Treat the tensors as
    read-only results (uniform turns may share one buffer).

    ``channels`` (only when the run was asked to keep them) maps each scorer to its own
    weighted token rewards per interaction, in the same compact-or-tensor form: what a
    trainer needs to combine scorers other than by summing them (see
    :class:`infra.schema.BranchResult`).
    """

    __slots__ = ("leaf_id", "path", "scorer_totals", "turn_results", "channels", "_rewards", "_tensors")

    def __init__(
        self,
        leaf_id: str,
        path: list[str],
        token_rewards: Mapping[str, torch.Tensor | TokenRewards],
        scorer_totals: dict[str, float],
        turn_results: list[PRMTurnResult],
        channels: Mapping[str, Mapping[str, torch.Tensor | TokenRewards]] | None = None,
    ) -> None:
        self.leaf_id = leaf_id
        self.path = path
        self.scorer_totals = scorer_totals
        self.turn_results = turn_results
        self.channels = {name: dict(turns) for name, turns in (channels or {}).items()}
        self._rewards = dict(token_rewards)
        self._tensors: dict[str, torch.Tensor] | None = None

    @property
    def token_rewards(self) -> dict[str, torch.Tensor]:
        """interaction id -> float32 tensor of shape ``[output_len]`` (path order)."""
        if self._tensors is None:
            import torch

            rewards = self._rewards
            uniform = [(iid, r) for iid, r in rewards.items() if isinstance(r, TokenRewards)]
            built: dict[str, torch.Tensor] = {}
            if uniform:
                sizes = [r.length for _, r in uniform]
                values = np.asarray(
                    [r.uniform if r.uniform is not None else np.nan for _, r in uniform], dtype=np.float32
                )
                pieces = torch.from_numpy(np.repeat(values, sizes)).split(sizes)
                for (iid, r), piece in zip(uniform, pieces):
                    built[iid] = piece if r.uniform is not None else torch.from_numpy(r.to_numpy().copy())
            self._tensors = {iid: built[iid] if isinstance(r, TokenRewards) else r for iid, r in rewards.items()}
        return self._tensors

    def to_branch_result(self) -> BranchResult:
        """Wire form: uniform turns as ``TokenRewards(uniform=...)``, dense ones as packed float32.

        Channels are included when the run kept them (and omitted from the encoding
        otherwise, see :class:`~infra.schema.BranchResult`).
        """
        return BranchResult(
            leaf_id=self.leaf_id,
            path=list(self.path),
            token_rewards=_wire(self._rewards),
            scorer_totals=dict(self.scorer_totals),
            channels={name: _wire(turns) for name, turns in self.channels.items()},
        )

    def __repr__(self) -> str:
        return (
            f"ScoredBranch(leaf_id={self.leaf_id!r}, path={self.path!r}, "
            f"scorer_totals={self.scorer_totals!r}, turns={len(self._rewards)})"
        )


def _wire(rewards: Mapping[str, torch.Tensor | TokenRewards]) -> dict[str, TokenRewards]:
    return {iid: r if isinstance(r, TokenRewards) else TokenRewards.from_array(r) for iid, r in rewards.items()}


@dataclass(frozen=True, slots=True)
class ScoredTrajectory:
    """The result of :meth:`PRMRunner.run`: one :class:`ScoredBranch` per branch.

    It exists only when every branch succeeded, so its :meth:`stats` can be published
    as they are.
    """

    trajectory_id: str
    session_id: str
    branches: list[ScoredBranch]
    is_eval: bool = False
    fallback: str | None = None
    """Set under ``error_policy: keep_original`` when scoring failed: the failure
    (``"keep_original: <code>: <detail>"``); the branches then carry the trajectory's
    original token rewards only, and :meth:`stats` is just ``prm_fallback``."""

    @property
    def turn_results(self) -> list[PRMTurnResult]:
        """Every branch's turn results, branch by branch (AReaL's typed ``prm_stats``)."""
        return [result for branch in self.branches for result in branch.turn_results]

    def to_branch_results(self) -> list[BranchResult]:
        """Wire form for :class:`infra.schema.SessionResult` (uniform turns stored compactly;
        per-scorer channels when the run was asked to keep them)."""
        return [branch.to_branch_result() for branch in self.branches]

    def stats(self, namespace: str | None = None) -> dict[str, float]:
        """The run's metrics (see the module docstring for names and merge rules).

        ``namespace`` defaults to ``eval-rollout`` for evaluation trajectories and
        ``rollout`` otherwise.
        """
        ns = stats_namespace(self.is_eval) if namespace is None else namespace
        if self.fallback is not None:  # AReaL reports the fallback, and no scoring stats
            return {metric_name(ns, "prm_fallback"): 1.0}
        turn: dict[str, list[float]] = {}  # scorer -> [sum, n]
        turn_results = self.turn_results
        for result in turn_results:
            acc = turn.setdefault(result.scorer_name, [0.0, 0])
            acc[0] += result.reward
            acc[1] += 1
        traj: dict[str, list[float]] = {}
        for branch in self.branches:
            for scorer, total in branch.scorer_totals.items():
                acc = traj.setdefault(scorer, [0.0, 0])
                acc[0] += total
                acc[1] += 1
        out: dict[str, float] = {}
        for kind, table in (("prm_turn_reward", turn), ("prm_trajectory_reward", traj)):
            for scorer, (total, n) in table.items():
                key = metric_name(ns, kind, _q(scorer))
                out[key] = total / n
                out[key + COUNT_SUFFIX] = float(n)
        # (scope, scorer, metric) -> (value_type, aggregations, values)
        observed: dict[tuple[str, str, str], tuple[str, tuple[str, ...], list[float]]] = {}
        for result in turn_results:
            for obs in result.observations:
                entry = observed.get((obs.scope, result.scorer_name, obs.metric_id))
                if entry is None:
                    entry = (obs.value_type, obs.aggregations, [])
                    observed[(obs.scope, result.scorer_name, obs.metric_id)] = entry
                entry[2].append(float(obs.value))
        for (scope, scorer, metric), (_value_type, aggregations, values) in observed.items():
            base = metric_name(ns, "prm_metric", scope, _q(scorer), _q(metric))
            n = len(values)
            total = sum(values)
            for aggregation in aggregations:
                key = f"{base}/{aggregation}"
                if aggregation in ("count", "sum"):  # boolean count = number true; float sum
                    out[key] = float(total)
                else:  # rate (fraction true) or mean
                    out[key] = total / n
                    out[key + COUNT_SUFFIX] = float(n)
            out[f"{base}/observed_count"] = float(n)
        return out
