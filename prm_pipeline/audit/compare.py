"""The audit's pure comparison: verdict members vs what re-scoring produced.

Long on purpose: every rule by which a re-scored member may differ from its verdict, side by side.

Wire structs in (:class:`~infra.schema.GroupVerdict`, :class:`~infra.schema.SessionResult`),
:class:`GroupFinding` out: no I/O, no runner, no Kafka, so it is unit-tested on
hand-built verdicts (tests/unit/test_audit_compare.py). It holds the tolerance
(:data:`RTOL`, :data:`ATOL`, :class:`Tolerance`), what was re-run
(:class:`ScoringScope`), the finding types (:class:`Difference`,
:class:`SessionComparison`, :class:`GroupFinding`) and the rules
(:func:`compare_session`, :func:`summarize_group`, :func:`compare_group`); see
``docs/audit.md``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

import msgspec
import numpy as np

from infra.schema import (
    BranchResult,
    GroupVerdict,
    PRMTurnResult,
    ScorerInfo,
    SessionResult,
)

# =========================================================================== tolerance
RTOL = 1e-5
"""Relative tolerance: about 84 float32 ULPs (float32 epsilon is 1.19e-7)."""
ATOL = 1e-6
"""Absolute tolerance, for values near zero where a relative bound means nothing."""


@dataclass(frozen=True, slots=True)
class Tolerance:
    """When a re-scored number counts as equal to the recorded one.

    ``|recorded - rescored| <= atol + rtol * max(|recorded|, |rescored|, scale)``.

    Token rewards travel as float32 and are summed across scorers in float32; turn
    rewards are float32 means. Re-scoring the same inputs with the same code in the
    same order reproduces them bit for bit, but a different CPU (SIMD width changes the
    order of a float32 reduction), a different torch/numpy build, or a scorer that
    sums its terms in another order may move the last few bits. The default (``RTOL``
    ~ 84 ULPs relative, ``ATOL`` 1e-6 absolute) absorbs such round-off of sums over
    dozens of float32 terms, while any change a person or a bug makes to a reward
    (typically >= 1e-3) is far outside it. Raise it with ``--rtol/--atol`` for scorers
    that accumulate long float32 sums; ``--rtol 0 --atol 0`` demands bit equality.
    """

    rtol: float = RTOL
    atol: float = ATOL

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"tolerance {name} must be a finite number >= 0, got {value!r}")

    def close(self, recorded: float, rescored: float, scale: float = 0.0) -> bool:
        return abs(recorded - rescored) <= self.atol + self.rtol * max(abs(recorded), abs(rescored), scale)

    def close_arrays(self, recorded: np.ndarray, rescored: np.ndarray) -> np.ndarray:
        bound = self.atol + self.rtol * np.maximum(np.abs(recorded), np.abs(rescored))
        return np.abs(recorded - rescored) <= bound


DEFAULT_TOLERANCE = Tolerance()


# =========================================================================== scoring scope
@dataclass(frozen=True)
class ScoringScope:
    """What the audit could re-run, from the configured scorers.

    ``scorers`` are the active scorers in config order (what verdicts record in
    ``GroupVerdict.scorers``); ``rescored`` are the names re-run in-process;
    ``not_rescored`` the active, non-deterministic ones, compared against the record
    only (see :func:`compare_session`). ``enabled`` is False when scoring is off in the
    config (verdicts then carry no rewards).
    """

    enabled: bool = True
    scorers: tuple[ScorerInfo, ...] = ()
    rescored: frozenset[str] = frozenset()
    not_rescored: frozenset[str] = frozenset()

    @property
    def complete(self) -> bool:
        """Every active scorer was re-run: results must match exactly (within tolerance)."""
        return not self.not_rescored

    @classmethod
    def of(cls, rescored: Iterable[str | ScorerInfo], not_rescored: Iterable[str] = ()) -> ScoringScope:
        """A scope from scorer names (version ``"1"``), config order = argument order."""
        infos = tuple(s if isinstance(s, ScorerInfo) else ScorerInfo(s, "1") for s in rescored)
        skipped = tuple(not_rescored)
        return cls(
            enabled=True,
            scorers=infos + tuple(ScorerInfo(n, "1") for n in skipped),
            rescored=frozenset(s.name for s in infos),
            not_rescored=frozenset(skipped),
        )


# =========================================================================== findings
DifferenceKind = Literal[
    "token_rewards",  # a turn's per-token rewards (the sum over scorers, weighted)
    "turn_result",  # one scorer's reward for one turn of one branch
    "observations",  # one scorer's metric observations for one turn
    "scorer_total",  # one scorer's total over a branch
    "stats",  # a session's metric dict (key in `key`)
    "branches",  # branch set or a branch's path
    "turns",  # the compact token tree the trainer trains on
    "field",  # session metadata: outcome_reward, is_eval, policy_version, ...
    "status",  # the member scored on one side and failed on the other (or failed differently)
    "verdict",  # the verdict contradicts itself (accepted with a failed member, ...)
    "scorers",  # the verdict's scorer names/versions are not the configured ones
    "conflicting_verdicts",  # two different verdicts for one (group_id, verdict_version)
]
SessionOutcome = Literal["identical", "differs", "not_rescorable", "missing_trajectory", "not_compared"]
GroupOutcome = Literal[
    "identical", "differs", "not_rescorable", "verdict_without_trajectory", "trajectory_without_verdict"
]
GROUP_OUTCOMES: tuple[str, ...] = (
    "identical",
    "differs",
    "not_rescorable",
    "verdict_without_trajectory",
    "trajectory_without_verdict",
)


class Difference(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One thing re-scoring did not reproduce. ``recorded``/``rescored`` hold the two
    values (for token rewards: at ``index``, the first token outside the tolerance);
    ``max_abs_diff`` is the largest absolute difference over what was compared (for
    token rewards: over the turn's tokens)."""

    kind: DifferenceKind
    detail: str = ""
    verdict_version: int | None = None
    variant: int | None = None
    trajectory_id: str | None = None
    session_id: str | None = None
    leaf_id: str | None = None
    turn: str | None = None
    scorer: str | None = None
    key: str | None = None
    index: int | None = None
    max_abs_diff: float | None = None
    recorded: Any = None
    rescored: Any = None


class SessionComparison(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The outcome for one member of one verdict."""

    outcome: SessionOutcome
    differences: list[Difference] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)


class GroupFinding(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One ``--out`` line: the audit's finding for one group.

    ``sessions`` counts member outcomes over every distinct verdict of the group;
    ``verdict_records`` counts records on the topic, duplicates included.
    """

    group_id: str
    outcome: GroupOutcome
    experiment_id: str = "default"  # the group's experiment (left out of the line when "default")
    status: str = ""
    reason: str = ""
    verdict_versions: list[int] = msgspec.field(default_factory=list)
    verdict_records: int = 0
    distinct_verdicts: int = 0
    sessions: dict[str, int] = msgspec.field(default_factory=dict)
    trajectories: list[str] = msgspec.field(default_factory=list)
    max_abs_diff: float | None = None
    differences: list[Difference] = msgspec.field(default_factory=list)
    differences_omitted: int = 0
    notes: list[str] = msgspec.field(default_factory=list)


# =========================================================================== pure comparison
def _stats_scorer(key: str) -> str | None:
    """The scorer a stats key belongs to (see scoring_workers.prm.results), or None."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[1] in ("prm_turn_reward", "prm_trajectory_reward"):
        return unquote(parts[2].removesuffix("__count"))
    if len(parts) >= 4 and parts[1] == "prm_metric":
        return unquote(parts[3])
    return None


def _turn_results_by_key(session: SessionResult) -> dict[tuple[str, str, str], PRMTurnResult] | None:
    """``(leaf_id, interaction_id, scorer) -> PRMTurnResult``; None when the results do not
    fit the verdict layout (:meth:`SessionResult.turn_result_blocks`) or repeat a key."""
    blocks = session.turn_result_blocks()
    if blocks is None:
        return None
    out = {
        (branch.leaf_id, tr.interaction_id, scorer): tr
        for branch, block in zip(session.branches, blocks)
        for scorer, chunk in block.items()
        for tr in chunk
    }
    return out if len(out) == len(session.turn_results) else None


def _first_turn_difference(recorded: SessionResult, rescored: SessionResult) -> Difference:
    """The first turn (verdict order, then re-scored-only turns) that differs and which of its fields do;
    when every turn is equal, the order of the turns differs."""
    rec = {t.interaction_id: t for t in recorded.turns}
    res = {t.interaction_id: t for t in rescored.turns}
    for iid in list(rec) + [i for i in res if i not in rec]:
        a, b = rec.get(iid), res.get(iid)
        if a != b:
            if a is None or b is None:
                detail = "turn only in the re-scored trajectory" if a is None else "turn only in the verdict"
            else:
                fields = [f for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)]
                detail = f"turn fields differ: {', '.join(fields)}"
            return Difference(kind="turns", turn=iid, detail=detail)
    return Difference(kind="turns", detail="turn order differs")


def _observation_mismatch(rec: PRMTurnResult, res: PRMTurnResult, tol: Tolerance) -> str | None:
    """Why two turn results' observations differ (count, shape, or a value: booleans exactly,
    numbers within ``tol``), or None."""
    if len(rec.observations) != len(res.observations):
        return f"{len(rec.observations)} recorded observations, {len(res.observations)} re-scored"
    for a, b in zip(rec.observations, res.observations):
        same_shape = (a.metric_id, a.scope, a.target_id, a.value_type, a.aggregations) == (
            b.metric_id,
            b.scope,
            b.target_id,
            b.value_type,
            b.aggregations,
        )
        if not same_shape:
            return f"observation {a.metric_id!r} vs {b.metric_id!r}: metric, scope, target or aggregations differ"
        if a.value_type == "boolean" or isinstance(a.value, bool) or isinstance(b.value, bool):
            if a.value != b.value:
                return f"observation {a.metric_id!r}: {a.value!r} recorded, {b.value!r} re-scored"
        elif not tol.close(float(a.value), float(b.value)):
            return f"observation {a.metric_id!r}: {a.value!r} recorded, {b.value!r} re-scored"
    return None


def _attribute(
    changed: set[str] | None,
    rec_tr: Mapping[tuple[str, str, str], PRMTurnResult] | None,
    leaf: str,
    iid: str,
    scorers: Iterable[str],
) -> tuple[str | None, str]:
    """Which scorer(s) a token-reward difference belongs to: ``(names, how)``.

    Token rewards are a weighted sum over scorers, so a token can only be pinned to a
    scorer through the per-scorer turn results: first the scorers whose turn result
    differs too; else the scorers with a nonzero recorded share of the turn (or the only
    scorer); else nobody.
    """
    if changed:
        return ",".join(sorted(changed)), ""
    names = list(scorers)
    contributors = sorted(
        s for s in names if rec_tr is not None and (tr := rec_tr.get((leaf, iid, s))) is not None and tr.reward != 0
    )
    if len(names) == 1:
        return names[0], ""
    if contributors:
        return ",".join(contributors), (
            "every scorer's turn reward matches; attributed to the scorers with a nonzero share of this turn"
        )
    return None, "every scorer's turn reward matches; the per-token values differ"


def _compare_branches(
    recorded: SessionResult, rescored: SessionResult, scope: ScoringScope, tol: Tolerance
) -> list[Difference]:
    """Branches, turn results, totals and token rewards of two scored sessions.

    Branch sets first, then per branch both sides hold with the same path: turn results
    and observations, scorer totals, the non-re-scored scorers' self-consistency, token
    rewards (in that order: a token difference is attributed to the scorers whose turn
    result differs on that turn).
    """
    diffs: list[Difference] = []
    rec_branches = {b.leaf_id: b for b in recorded.branches}
    res_branches = {b.leaf_id: b for b in rescored.branches}
    for leaf in rec_branches.keys() - res_branches.keys():
        diffs.append(Difference(kind="branches", leaf_id=leaf, detail="branch in the verdict but not re-scored"))
    for leaf in res_branches.keys() - rec_branches.keys():
        diffs.append(Difference(kind="branches", leaf_id=leaf, detail="re-scoring found a branch the verdict lacks"))
    rec_tr = _turn_results_by_key(recorded)
    res_tr = _turn_results_by_key(rescored)
    if rec_tr is None:
        diffs.append(
            Difference(kind="turn_result", detail="the verdict's turn_results do not line up with its branches")
        )
    if res_tr is None:  # cannot happen for runner output; never compare silently
        diffs.append(Difference(kind="turn_result", detail="re-scored turn_results do not line up with branches"))
    for leaf, rec in rec_branches.items():
        res = res_branches.get(leaf)
        if res is None:
            continue
        if rec.path != res.path:
            diffs.append(
                Difference(
                    kind="branches",
                    leaf_id=leaf,
                    detail="branch path differs",
                    recorded=list(rec.path),
                    rescored=list(res.path),
                )
            )
            continue
        changed: dict[str, set[str]] = {}  # turn -> scorers whose turn result differs
        if rec_tr is not None and res_tr is not None:
            diffs += _compare_turn_results(leaf, rec.path, rec_tr, res_tr, changed, scope, tol)
        diffs += _compare_totals(leaf, rec, res, scope, tol)
        if rec_tr is not None:
            diffs += _check_recorded_totals(leaf, rec, rec_tr, scope, tol)
        diffs += _compare_token_rewards(leaf, rec, res, rec_tr, changed, scope, tol)
    return diffs


def _compare_turn_results(
    leaf: str,
    path: Sequence[str],
    rec_tr: Mapping[tuple[str, str, str], PRMTurnResult],
    res_tr: Mapping[tuple[str, str, str], PRMTurnResult],
    changed: dict[str, set[str]],
    scope: ScoringScope,
    tol: Tolerance,
) -> list[Difference]:
    """Each re-scored scorer's turn results and observations along one branch.

    Adds to ``changed`` (turn -> scorers) every turn result that is missing or differs:
    :func:`_attribute` pins that turn's token-reward differences on those scorers.
    """
    diffs: list[Difference] = []
    for scorer in sorted(scope.rescored):
        for iid in path:
            a, b = rec_tr.get((leaf, iid, scorer)), res_tr.get((leaf, iid, scorer))
            if a is None or b is None:
                diffs.append(
                    Difference(
                        kind="turn_result",
                        leaf_id=leaf,
                        turn=iid,
                        scorer=scorer,
                        detail="turn result missing in the verdict" if a is None else "turn result not re-scored",
                    )
                )
                changed.setdefault(iid, set()).add(scorer)
                continue
            if not tol.close(a.reward, b.reward):
                diffs.append(
                    Difference(
                        kind="turn_result",
                        leaf_id=leaf,
                        turn=iid,
                        scorer=scorer,
                        max_abs_diff=abs(a.reward - b.reward),
                        recorded=a.reward,
                        rescored=b.reward,
                    )
                )
                changed.setdefault(iid, set()).add(scorer)
            mismatch = _observation_mismatch(a, b, tol)
            if mismatch:
                diffs.append(Difference(kind="observations", leaf_id=leaf, turn=iid, scorer=scorer, detail=mismatch))
    return diffs


def _compare_totals(
    leaf: str, rec: BranchResult, res: BranchResult, scope: ScoringScope, tol: Tolerance
) -> list[Difference]:
    """One branch's per-scorer totals: each re-scored scorer's against re-scoring, and none
    recorded for a scorer the config does not run."""
    diffs: list[Difference] = []
    for scorer in sorted(scope.rescored):
        a_total, b_total = rec.scorer_totals.get(scorer), res.scorer_totals.get(scorer)
        if a_total is None or b_total is None:
            diffs.append(
                Difference(
                    kind="scorer_total",
                    leaf_id=leaf,
                    scorer=scorer,
                    detail="missing in the verdict" if a_total is None else "not re-scored",
                )
            )
        elif not tol.close(a_total, b_total):
            diffs.append(
                Difference(
                    kind="scorer_total",
                    leaf_id=leaf,
                    scorer=scorer,
                    max_abs_diff=abs(a_total - b_total),
                    recorded=a_total,
                    rescored=b_total,
                )
            )
    for scorer in sorted(set(rec.scorer_totals) - (scope.rescored | scope.not_rescored)):
        diffs.append(
            Difference(
                kind="scorer_total",
                leaf_id=leaf,
                scorer=scorer,
                detail="the verdict has a total for a scorer the config does not run",
            )
        )
    return diffs


def _check_recorded_totals(
    leaf: str,
    rec: BranchResult,
    rec_tr: Mapping[tuple[str, str, str], PRMTurnResult],
    scope: ScoringScope,
    tol: Tolerance,
) -> list[Difference]:
    """The non-re-scored scorers' recorded totals on one branch against their recorded turn results.

    Nothing re-ran them, so the record can only be checked against itself: a total is the
    sum of the scorer's turn results along the branch.
    """
    diffs: list[Difference] = []
    for scorer in sorted(scope.not_rescored):
        total = rec.scorer_totals.get(scorer)
        parts = [rec_tr.get((leaf, iid, scorer)) for iid in rec.path]
        if total is None or any(p is None for p in parts):
            diffs.append(
                Difference(
                    kind="scorer_total",
                    leaf_id=leaf,
                    scorer=scorer,
                    detail="no recorded total or turn results for this scorer",
                )
            )
            continue
        summed = sum(p.reward for p in parts if p is not None)
        if not tol.close(total, summed):
            diffs.append(
                Difference(
                    kind="scorer_total",
                    leaf_id=leaf,
                    scorer=scorer,
                    max_abs_diff=abs(total - summed),
                    recorded=total,
                    rescored=summed,
                    detail="recorded total != sum of its recorded turn results",
                )
            )
    return diffs


def _compare_token_rewards(
    leaf: str,
    rec: BranchResult,
    res: BranchResult,
    rec_tr: Mapping[tuple[str, str, str], PRMTurnResult] | None,
    changed: Mapping[str, set[str]],
    scope: ScoringScope,
    tol: Tolerance,
) -> list[Difference]:
    """One branch's per-token rewards, turn by turn.

    With every scorer re-run, token by token (the first token outside the tolerance is
    reported, attributed by :func:`_attribute`). Otherwise the recorded rewards hold the
    non-re-scored scorers' share too: recorded minus re-scored must average to those
    scorers' recorded turn rewards.
    """
    diffs: list[Difference] = []
    for iid in rec.path:
        a_tok, b_tok = rec.token_rewards.get(iid), res.token_rewards.get(iid)
        if a_tok is None or b_tok is None:
            diffs.append(
                Difference(
                    kind="token_rewards",
                    leaf_id=leaf,
                    turn=iid,
                    detail="missing in the verdict" if a_tok is None else "not re-scored",
                )
            )
            continue
        if a_tok.length != b_tok.length:
            diffs.append(
                Difference(
                    kind="token_rewards",
                    leaf_id=leaf,
                    turn=iid,
                    detail="number of tokens differs",
                    recorded=a_tok.length,
                    rescored=b_tok.length,
                )
            )
            continue
        a = a_tok.to_numpy().astype(np.float64)
        b = b_tok.to_numpy().astype(np.float64)
        if scope.complete:
            ok = tol.close_arrays(a, b)
            if bool(ok.all()):
                continue
            index = int(np.argmin(ok))
            scorer, detail = _attribute(changed.get(iid), rec_tr, leaf, iid, rec.scorer_totals)
            diffs.append(
                Difference(
                    kind="token_rewards",
                    leaf_id=leaf,
                    turn=iid,
                    scorer=scorer,
                    index=index,
                    max_abs_diff=float(np.max(np.abs(a - b))),
                    recorded=float(a[index]),
                    rescored=float(b[index]),
                    detail=detail,
                )
            )
        elif rec_tr is not None and a.size:
            # The non-re-scored scorers' share of this turn is recorded - re-scored; its
            # mean must be the sum of their recorded (weighted, mean) turn rewards.
            parts = [rec_tr.get((leaf, iid, s)) for s in scope.not_rescored]
            if any(p is None for p in parts):
                continue  # reported by _check_recorded_totals as a missing turn result / total
            expected = sum(p.reward for p in parts if p is not None)
            residual = float(np.mean(a - b))
            scale = float(np.max(np.abs(a))) if a.size else 0.0
            if not tol.close(residual, expected, scale=scale):
                diffs.append(
                    Difference(
                        kind="token_rewards",
                        leaf_id=leaf,
                        turn=iid,
                        scorer=",".join(sorted(scope.not_rescored)),
                        max_abs_diff=abs(residual - expected),
                        recorded=residual,
                        rescored=expected,
                        detail="recorded token rewards minus the re-scored scorers' share do not average to the "
                        "non-re-scored scorers' recorded turn rewards",
                    )
                )
    return diffs


def _compare_stats(
    recorded: Mapping[str, float], rescored: Mapping[str, float], scope: ScoringScope, tol: Tolerance
) -> list[Difference]:
    """A session's stats key by key; keys of scorers that were not re-run are left out."""
    diffs: list[Difference] = []
    for key in sorted(set(recorded) | set(rescored)):
        scorer = _stats_scorer(key)
        if scorer is not None and scorer in scope.not_rescored:
            continue  # not re-run: nothing to compare with
        a, b = recorded.get(key), rescored.get(key)
        if a is None or b is None:
            diffs.append(
                Difference(
                    kind="stats",
                    key=key,
                    scorer=scorer,
                    recorded=a,
                    rescored=b,
                    detail="missing in the verdict" if a is None else "not produced by re-scoring",
                )
            )
        elif not tol.close(a, b):
            diffs.append(
                Difference(kind="stats", key=key, scorer=scorer, max_abs_diff=abs(a - b), recorded=a, rescored=b)
            )
    return diffs


_METADATA = ("session_id", "outcome_reward", "is_eval", "policy_version", "created_at")


def compare_session(
    recorded: SessionResult,
    rescored: SessionResult | None,
    *,
    scope: ScoringScope,
    tol: Tolerance = DEFAULT_TOLERANCE,
) -> SessionComparison:
    """Compare one verdict member with what re-scoring its trajectory produced.

    ``rescored`` is :func:`rescore`'s output for the member's trajectory, or None when
    the trajectory was not found. Rules (docs/audit.md):

    * ``discarded`` / ``missing`` / ``pending`` members are not scored by the pipeline:
      not compared, but they must carry no results.
    * scored vs scored: metadata, the compact token tree, branches, every re-scored
      scorer's turn results / observations / totals, token rewards and stats. With
      non-deterministic scorers in the config (``scope.not_rescored``) their share is
      checked against the record (totals = sum of turn results; token rewards minus the
      re-scored share average to their recorded turn rewards) and the member is
      ``not_rescorable`` when nothing else differs.
    * failed vs failed: the reason codes (``scorer_error``, ``not_concat_export``, ...)
      must agree.
    * scored on one side, failed on the other: ``differs``, except when the failure is
      a timeout (load-dependent: ``not_rescorable``), or the recorded failure may come
      from a scorer the audit did not re-run (``not_rescorable``).
    """
    where = {"trajectory_id": recorded.trajectory_id, "session_id": recorded.session_id}

    def located(diffs: Iterable[Difference]) -> list[Difference]:
        return [msgspec.structs.replace(d, **where) for d in diffs]

    if recorded.status not in ("scored", "failed"):
        if recorded.branches or recorded.turn_results or recorded.stats:
            return SessionComparison(
                outcome="differs",
                differences=located(
                    [
                        Difference(
                            kind="field",
                            key="status",
                            recorded=recorded.status,
                            detail=f"a {recorded.status} member carries scoring results",
                        )
                    ]
                ),
            )
        return SessionComparison(outcome="not_compared")
    if rescored is None:
        return SessionComparison(
            outcome="missing_trajectory",
            notes=[f"trajectory {recorded.trajectory_id!r} is not on the trajectories topic (in the audited range)"],
        )
    diffs: list[Difference] = []
    notes: list[str] = []
    for name in _METADATA:
        a, b = getattr(recorded, name), getattr(rescored, name)
        if a != b:
            diffs.append(Difference(kind="field", key=name, recorded=a, rescored=b))
    inconclusive = False
    if recorded.status == "scored" and rescored.status == "scored":
        if recorded.turns != rescored.turns:
            diffs.append(_first_turn_difference(recorded, rescored))
        diffs += _compare_branches(recorded, rescored, scope, tol)
        diffs += _compare_stats(recorded.stats, rescored.stats, scope, tol)
        if not scope.complete:
            inconclusive = True
            notes.append(
                f"scorers {sorted(scope.not_rescored)} are non-deterministic: checked against the "
                "verdict's own record, not re-run"
            )
    else:
        difference, why_inconclusive = _failure_mismatch(recorded, rescored, scope)
        if difference is not None:
            diffs.append(difference)
        if why_inconclusive is not None:
            inconclusive = True
            notes.append(why_inconclusive)
    if diffs:
        return SessionComparison(outcome="differs", differences=located(diffs), notes=notes)
    return SessionComparison(outcome="not_rescorable" if inconclusive else "identical", notes=notes)


def _failure_mismatch(
    recorded: SessionResult, rescored: SessionResult, scope: ScoringScope
) -> tuple[Difference | None, str | None]:
    """A member that failed on at least one side: ``(difference, None)``, ``(None, why inconclusive)``,
    or ``(None, None)`` when both failed for the same reason.

    A timeout on either side depends on load, not on the member, and a recorded failure
    that may come from a scorer the audit did not re-run cannot be reproduced: both are
    inconclusive rather than differences.
    """
    rec_code = recorded.failure_code if recorded.status == "failed" else None
    res_code = rescored.failure_code if rescored.status == "failed" else None
    if recorded.status == "failed" and rescored.status == "failed":
        if rec_code == res_code:
            return None, None
        if res_code == "scorer_timeout":
            return None, f"re-scoring timed out; the verdict recorded {rec_code}"
        return Difference(
            kind="status",
            recorded=recorded.error,
            rescored=rescored.error,
            detail=f"failed with {rec_code} in the verdict, {res_code} when re-scored",
        ), None
    if recorded.status == "scored":  # re-scoring failed
        if res_code == "scorer_timeout":
            return None, "re-scoring timed out (raise --scorer-timeout); the verdict recorded a scored member"
        return Difference(
            kind="status",
            recorded="scored",
            rescored=rescored.error,
            scorer=rescored.error_scorer,
            detail="scored in the verdict, rejected when re-scored",
        ), None
    # recorded failed, re-scoring succeeded
    culprit = recorded.error_scorer
    if rec_code == "scorer_timeout":
        return None, "the verdict recorded a timeout; re-scoring succeeded (timeouts depend on load)"
    if not scope.complete and (culprit is None or culprit in scope.not_rescored):
        return None, (
            f"the recorded failure ({rec_code}) may come from a non-re-scored scorer "
            f"({culprit or 'unknown'}); the re-scored scorers succeeded"
        )
    return Difference(
        kind="status",
        recorded=recorded.error,
        rescored="scored",
        scorer=culprit,
        detail=f"failed with {rec_code} in the verdict, scored when re-scored",
    ), None


def distinct_verdicts(records: Iterable[GroupVerdict]) -> list[tuple[GroupVerdict, int]]:
    """Collapse redelivered copies: ``[(verdict, copies)]`` per distinct verdict, first seen first.

    At-least-once delivery makes identical copies of a ``(group_id, verdict_version)``
    expected; they are compared once. Two *different* verdicts for one key are both
    kept (and reported by :func:`summarize_group` as ``conflicting_verdicts``).
    """
    out: list[list[Any]] = []
    for verdict in records:
        for entry in out:
            if entry[0] == verdict:
                entry[1] += 1
                break
        else:
            out.append([verdict, 1])
    return [(v, n) for v, n in out]


def _verdict_self_check(verdict: GroupVerdict) -> list[Difference]:
    """Where a verdict contradicts itself: a trajectory listed twice, an accepted group with an
    unscored member or the wrong member count, a rejection without a reason, a discarded
    group with members that are not discarded."""
    diffs: list[Difference] = []
    ids = [s.trajectory_id for s in verdict.sessions]
    if len(set(ids)) != len(ids):
        dupes = sorted(i for i, n in Counter(ids).items() if n > 1)
        diffs.append(Difference(kind="verdict", detail=f"trajectories listed twice: {dupes}"))
    statuses = Counter(s.status for s in verdict.sessions)
    if verdict.status == "accepted":
        if set(statuses) - {"scored"}:
            diffs.append(Difference(kind="verdict", detail=f"accepted with member statuses {dict(statuses)}"))
        if len(verdict.sessions) != verdict.group_size:
            diffs.append(
                Difference(
                    kind="verdict",
                    recorded=len(verdict.sessions),
                    rescored=verdict.group_size,
                    detail="accepted with a member count different from group_size",
                )
            )
    elif verdict.status == "rejected" and not verdict.reason:
        diffs.append(Difference(kind="verdict", detail="rejected without a reason"))
    elif verdict.status == "discarded" and set(statuses) - {"discarded"}:
        diffs.append(Difference(kind="verdict", detail=f"discarded with member statuses {dict(statuses)}"))
    return diffs


def _conflicting_verdicts(group_id: str, variants: Sequence[tuple[GroupVerdict, int]]) -> list[Difference]:
    """One ``conflicting_verdicts`` difference per verdict version with more than one distinct verdict.

    Redelivered copies were collapsed by :func:`distinct_verdicts`; what is left under one
    version is two decisions for one group, and the difference names the fields they disagree on.
    """
    by_version: dict[int, list[GroupVerdict]] = {}
    for verdict, _copies in variants:
        by_version.setdefault(verdict.verdict_version, []).append(verdict)
    conflicts: list[Difference] = []
    for version, found in sorted(by_version.items()):
        if len(found) > 1:
            head = found[0]
            fields = sorted(
                {f for other in found[1:] for f in head.__struct_fields__ if getattr(head, f) != getattr(other, f)}
            )
            conflicts.append(
                Difference(
                    kind="conflicting_verdicts",
                    verdict_version=version,
                    recorded=len(found),
                    detail=f"{len(found)} different verdicts for ({group_id!r}, version {version}); "
                    f"fields that differ: {', '.join(fields)}",
                )
            )
    return conflicts


def _group_outcome(*, differs: bool, missing: bool, inconclusive: bool) -> GroupOutcome:
    """The precedence of a group's outcome: a difference outweighs a missing trajectory, which
    outweighs an inconclusive member; a group with none of them is ``identical``."""
    if differs:
        return "differs"
    if missing:
        return "verdict_without_trajectory"
    if inconclusive:
        return "not_rescorable"
    return "identical"


def summarize_group(
    group_id: str,
    variants: Sequence[tuple[GroupVerdict, int]],
    comparisons: Sequence[Sequence[SessionComparison]],
    *,
    scope: ScoringScope,
    trajectories_seen: Iterable[str] = (),
    discard_seen: bool = False,
    max_differences: int = 100,
    notes: Iterable[str] = (),
) -> GroupFinding:
    """One group's finding from its distinct verdicts and their members' comparisons.

    ``comparisons[i][j]`` compares ``variants[i][0].sessions[j]``. Outcome precedence:
    ``differs`` > ``verdict_without_trajectory`` > ``not_rescorable`` > ``identical``.
    """
    diffs: list[Difference] = []
    all_notes: list[str] = list(notes)
    sessions: Counter[str] = Counter()
    missing = False
    inconclusive = False
    variant_no: Counter[int] = Counter()
    configured = [(s.name, s.version) for s in scope.scorers]
    for (verdict, _copies), per_session in zip(variants, comparisons):
        version = verdict.verdict_version
        index = variant_no[version]
        variant_no[version] += 1
        tag = {"verdict_version": version, "variant": index}
        local = _verdict_self_check(verdict)
        if verdict.status != "discarded" and [(s.name, s.version) for s in verdict.scorers] != configured:
            local.append(
                Difference(
                    kind="scorers",
                    recorded=[f"{s.name}@{s.version}" for s in verdict.scorers],
                    rescored=[f"{n}@{v}" for n, v in configured],
                    detail="the verdict was scored by other scorers (names@versions) than configured",
                )
            )
        if verdict.status == "discarded" and not discard_seen:
            missing = True
            all_notes.append("discarded, but no DiscardGroup record for the group is in the audited range")
        for comparison in per_session:
            sessions[comparison.outcome] += 1
            local += comparison.differences
            all_notes += comparison.notes
            missing |= comparison.outcome == "missing_trajectory"
            inconclusive |= comparison.outcome == "not_rescorable"
        diffs += [msgspec.structs.replace(d, **tag) for d in local]
    diffs = _conflicting_verdicts(group_id, variants) + diffs  # group-level first: never cut by max_differences
    listed = {s.trajectory_id for verdict, _ in variants for s in verdict.sessions}
    unlisted = sorted(set(trajectories_seen) - listed)
    if unlisted:
        all_notes.append(
            f"trajectories on the topic but in no verdict of the group (late or extra members): {unlisted[:20]}"
        )
    outcome = _group_outcome(differs=bool(diffs), missing=missing, inconclusive=inconclusive)
    magnitudes = [d.max_abs_diff for d in diffs if d.max_abs_diff is not None]
    first = variants[0][0] if variants else None
    dedup_notes = list(dict.fromkeys(all_notes))
    return GroupFinding(
        group_id=group_id,
        outcome=outcome,
        status=first.status if first else "",
        reason=first.reason if first else "",
        verdict_versions=sorted({verdict.verdict_version for verdict, _ in variants}),
        verdict_records=sum(n for _, n in variants),
        distinct_verdicts=len(variants),
        sessions=dict(sorted(sessions.items())),
        max_abs_diff=max(magnitudes) if magnitudes else None,
        differences=diffs[:max_differences],
        differences_omitted=max(0, len(diffs) - max_differences),
        notes=dedup_notes[:50],
    )


def compare_group(
    records: Sequence[GroupVerdict],
    rescored: Mapping[str, SessionResult],
    *,
    scope: ScoringScope,
    tol: Tolerance = DEFAULT_TOLERANCE,
    trajectories_seen: Iterable[str] | None = None,
    discard_seen: bool = False,
    max_differences: int = 100,
) -> GroupFinding:
    """Everything recorded for one group against re-scoring results keyed by trajectory id.

    ``records`` are every verdict record of the group (duplicates included);
    ``rescored`` maps trajectory ids to :func:`rescore` results (a missing id means the
    trajectory was not found). ``trajectories_seen`` defaults to ``rescored``'s keys.
    """
    if not records:
        raise ValueError("compare_group needs at least one verdict record")
    variants = distinct_verdicts(records)
    comparisons = [
        [compare_session(s, rescored.get(s.trajectory_id), scope=scope, tol=tol) for s in verdict.sessions]
        for verdict, _ in variants
    ]
    return summarize_group(
        records[0].group_id,
        variants,
        comparisons,
        scope=scope,
        trajectories_seen=rescored.keys() if trajectories_seen is None else trajectories_seen,
        discard_seen=discard_seen,
        max_differences=max_differences,
    )
