"""``prm-pipeline audit``: re-score recorded trajectories and compare with the recorded verdicts.

The audit answers one question: *would the scorers configured today give the trainer
exactly what the verdicts topic says it got?* It reads ``prm.verdicts`` and
``prm.trajectories`` with throw-away, group-less consumers (no consumer group, nothing
committed: production offsets are never touched), re-scores every recorded member
in-process with :class:`~scoring_workers.prm.PRMRunner` and compares, member by member,
what re-scoring produced with what the verdict recorded. It needs no Redis: the
ledger's state is not an input, only the two topics are.

The module has three layers, in this order:

1. **Pure comparison** (:func:`compare_session`, :func:`compare_group`,
   :func:`summarize_group`, :class:`Tolerance`, :class:`ScoringScope`): wire structs in,
   :class:`GroupFinding` out. No I/O, no runner; unit-tested on hand-built verdicts.
2. **Re-scoring and bookkeeping** (:func:`rescore`, :class:`Auditor`): decodes records,
   matches verdict sessions to trajectories by ``trajectory_id``, re-scores each
   referenced trajectory once with bounded concurrency, keeps only the comparisons.
3. **Kafka and the command line** (:func:`read_snapshot`, :func:`audit`,
   :func:`add_audit_parser`): reads both topics up to the end they had when the audit
   started, draws the progress bar, writes ``--out`` and the summary.

See ``docs/audit.md`` for the rules (tolerance, failed members, non-deterministic
scorers, duplicate and conflicting verdicts) and the output format.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

import msgspec
import numpy as np

from infra.config import PipelineConfig, PRMConfig
from infra.schema import (
    DiscardGroup,
    GroupVerdict,
    NotConcatExport,
    PRMTurnResult,
    ReadyTrajectory,
    SchemaError,
    ScorerInfo,
    SessionResult,
    compact_turns,
    decode_message,
    decode_verdict,
)
from scoring_workers.verdicts import error_code

if TYPE_CHECKING:
    from scoring_workers.prm import PRMRunner

__all__ = [
    "ATOL",
    "RTOL",
    "AuditError",
    "AuditOptions",
    "AuditReport",
    "Auditor",
    "Difference",
    "GroupFinding",
    "ScoringScope",
    "SessionComparison",
    "Tolerance",
    "add_audit_parser",
    "audit",
    "cmd_audit",
    "compare_group",
    "compare_session",
    "distinct_verdicts",
    "parse_offsets",
    "read_snapshot",
    "rescore",
    "run_audit",
    "scorer_is_deterministic",
    "summarize_group",
]


class AuditError(RuntimeError):
    """The audit cannot run (a topic is missing, an offset names no partition, ...)."""


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


# =========================================================================== scorer determinism
def scorer_is_deterministic(scorer: Any) -> bool:
    """Whether re-running ``scorer`` on the same trajectory must give the same result.

    Scorers declare it with ``deterministic`` (``BaseScorer`` says True; the LLM judges
    make it a property that is True only at temperature 0; a callable is called).
    Re-calling a sampling judge would cost money and report noise as differences.
    """
    declared = getattr(scorer, "deterministic", True)
    return bool(declared() if callable(declared) else declared)


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
    "identical", "differs", "not_rescorable", "verdict_without_trajectory", "trajectory_without_verdict",
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
_SCORER_IN_ERROR = re.compile(r"scorer '([^']+)'")


def _failed_scorer(error: str | None) -> str | None:
    """The scorer a recorded failure names (``"scorer_error: scorer 'x' raised ..."``)."""
    match = _SCORER_IN_ERROR.search(error or "")
    return match.group(1) if match else None


def _stats_scorer(key: str) -> str | None:
    """The scorer a stats key belongs to (see scoring_workers.prm.results), or None."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[1] in ("prm_turn_reward", "prm_trajectory_reward"):
        return unquote(parts[2].removesuffix("__count"))
    if len(parts) >= 4 and parts[1] == "prm_metric":
        return unquote(parts[3])
    return None


def _turn_results_by_key(session: SessionResult) -> dict[tuple[str, str, str], PRMTurnResult] | None:
    """``(leaf_id, interaction_id, scorer) -> PRMTurnResult``.

    A session's ``turn_results`` are flattened branch by branch, each branch holding
    ``len(path) * len(scorer_totals)`` entries (every active scorer, every turn).
    Returns None when the list does not line up with the branches.
    """
    out: dict[tuple[str, str, str], PRMTurnResult] = {}
    results = session.turn_results
    pos = 0
    for branch in session.branches:
        n = len(branch.path) * len(branch.scorer_totals)
        chunk = results[pos : pos + n]
        if len(chunk) != n:
            return None
        for tr in chunk:
            key = (branch.leaf_id, tr.interaction_id, tr.scorer_name)
            if key in out or tr.interaction_id not in branch.path:
                return None
            out[key] = tr
        pos += n
    return out if pos == len(results) else None


def _first_turn_difference(recorded: SessionResult, rescored: SessionResult) -> Difference:
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
    if len(rec.observations) != len(res.observations):
        return f"{len(rec.observations)} recorded observations, {len(res.observations)} re-scored"
    for a, b in zip(rec.observations, res.observations):
        same_shape = (a.metric_id, a.scope, a.target_id, a.value_type, a.aggregations) == (
            b.metric_id, b.scope, b.target_id, b.value_type, b.aggregations
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
        return ",".join(contributors), ("every scorer's turn reward matches; attributed to the scorers with a "
                                        "nonzero share of this turn")
    return None, "every scorer's turn reward matches; the per-token values differ"


def _compare_branches(
    recorded: SessionResult, rescored: SessionResult, scope: ScoringScope, tol: Tolerance
) -> list[Difference]:
    """Branches, turn results, totals and token rewards of two scored sessions."""
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
        diffs.append(Difference(kind="turn_result", detail="the verdict's turn_results do not line up with its branches"))
    if res_tr is None:  # cannot happen for runner output; never compare silently
        diffs.append(Difference(kind="turn_result", detail="re-scored turn_results do not line up with branches"))
    configured = scope.rescored | scope.not_rescored
    for leaf, rec in rec_branches.items():
        res = res_branches.get(leaf)
        if res is None:
            continue
        if rec.path != res.path:
            diffs.append(Difference(kind="branches", leaf_id=leaf, detail="branch path differs",
                                    recorded=list(rec.path), rescored=list(res.path)))
            continue
        # ---- turn results and observations, per re-scored scorer
        changed: dict[str, set[str]] = {}  # turn -> scorers whose turn result differs
        if rec_tr is not None and res_tr is not None:
            for scorer in sorted(scope.rescored):
                for iid in rec.path:
                    a, b = rec_tr.get((leaf, iid, scorer)), res_tr.get((leaf, iid, scorer))
                    if a is None or b is None:
                        diffs.append(Difference(
                            kind="turn_result", leaf_id=leaf, turn=iid, scorer=scorer,
                            detail="turn result missing in the verdict" if a is None else "turn result not re-scored",
                        ))
                        changed.setdefault(iid, set()).add(scorer)
                        continue
                    if not tol.close(a.reward, b.reward):
                        diffs.append(Difference(kind="turn_result", leaf_id=leaf, turn=iid, scorer=scorer,
                                                max_abs_diff=abs(a.reward - b.reward), recorded=a.reward,
                                                rescored=b.reward))
                        changed.setdefault(iid, set()).add(scorer)
                    mismatch = _observation_mismatch(a, b, tol)
                    if mismatch:
                        diffs.append(Difference(kind="observations", leaf_id=leaf, turn=iid, scorer=scorer,
                                                detail=mismatch))
        # ---- scorer totals
        for scorer in sorted(scope.rescored):
            a_total, b_total = rec.scorer_totals.get(scorer), res.scorer_totals.get(scorer)
            if a_total is None or b_total is None:
                diffs.append(Difference(kind="scorer_total", leaf_id=leaf, scorer=scorer,
                                        detail="missing in the verdict" if a_total is None else "not re-scored"))
            elif not tol.close(a_total, b_total):
                diffs.append(Difference(kind="scorer_total", leaf_id=leaf, scorer=scorer,
                                        max_abs_diff=abs(a_total - b_total), recorded=a_total, rescored=b_total))
        for scorer in sorted(set(rec.scorer_totals) - configured):
            diffs.append(Difference(kind="scorer_total", leaf_id=leaf, scorer=scorer,
                                    detail="the verdict has a total for a scorer the config does not run"))
        if rec_tr is not None:  # non-re-scored scorers: the record must at least agree with itself
            for scorer in sorted(scope.not_rescored):
                total = rec.scorer_totals.get(scorer)
                parts = [rec_tr.get((leaf, iid, scorer)) for iid in rec.path]
                if total is None or any(p is None for p in parts):
                    diffs.append(Difference(kind="scorer_total", leaf_id=leaf, scorer=scorer,
                                            detail="no recorded total or turn results for this scorer"))
                    continue
                summed = sum(p.reward for p in parts)  # type: ignore[union-attr]
                if not tol.close(total, summed):
                    diffs.append(Difference(kind="scorer_total", leaf_id=leaf, scorer=scorer,
                                            max_abs_diff=abs(total - summed), recorded=total, rescored=summed,
                                            detail="recorded total != sum of its recorded turn results"))
        # ---- token rewards
        for iid in rec.path:
            a_tok, b_tok = rec.token_rewards.get(iid), res.token_rewards.get(iid)
            if a_tok is None or b_tok is None:
                diffs.append(Difference(kind="token_rewards", leaf_id=leaf, turn=iid,
                                        detail="missing in the verdict" if a_tok is None else "not re-scored"))
                continue
            if a_tok.length != b_tok.length:
                diffs.append(Difference(kind="token_rewards", leaf_id=leaf, turn=iid,
                                        detail="number of tokens differs", recorded=a_tok.length,
                                        rescored=b_tok.length))
                continue
            a = a_tok.to_numpy().astype(np.float64)
            b = b_tok.to_numpy().astype(np.float64)
            if scope.complete:
                ok = tol.close_arrays(a, b)
                if bool(ok.all()):
                    continue
                index = int(np.argmin(ok))
                scorer, detail = _attribute(changed.get(iid), rec_tr, leaf, iid, rec.scorer_totals)
                diffs.append(Difference(
                    kind="token_rewards", leaf_id=leaf, turn=iid, scorer=scorer, index=index,
                    max_abs_diff=float(np.max(np.abs(a - b))), recorded=float(a[index]), rescored=float(b[index]),
                    detail=detail,
                ))
            elif rec_tr is not None and a.size:
                # The non-re-scored scorers' share of this turn is recorded - re-scored; its
                # mean must be the sum of their recorded (weighted, mean) turn rewards.
                parts = [rec_tr.get((leaf, iid, s)) for s in scope.not_rescored]
                if any(p is None for p in parts):
                    continue  # reported above as a missing turn result / total
                expected = sum(p.reward for p in parts)  # type: ignore[union-attr]
                residual = float(np.mean(a - b))
                scale = float(np.max(np.abs(a))) if a.size else 0.0
                if not tol.close(residual, expected, scale=scale):
                    diffs.append(Difference(
                        kind="token_rewards", leaf_id=leaf, turn=iid, scorer=",".join(sorted(scope.not_rescored)),
                        max_abs_diff=abs(residual - expected), recorded=residual, rescored=expected,
                        detail="recorded token rewards minus the re-scored scorers' share do not average to the "
                               "non-re-scored scorers' recorded turn rewards",
                    ))
    return diffs


def _compare_stats(recorded: Mapping[str, float], rescored: Mapping[str, float], scope: ScoringScope,
                   tol: Tolerance) -> list[Difference]:
    diffs: list[Difference] = []
    for key in sorted(set(recorded) | set(rescored)):
        scorer = _stats_scorer(key)
        if scorer is not None and scorer in scope.not_rescored:
            continue  # not re-run: nothing to compare with
        a, b = recorded.get(key), rescored.get(key)
        if a is None or b is None:
            diffs.append(Difference(kind="stats", key=key, scorer=scorer, recorded=a, rescored=b,
                                    detail="missing in the verdict" if a is None else "not produced by re-scoring"))
        elif not tol.close(a, b):
            diffs.append(Difference(kind="stats", key=key, scorer=scorer, max_abs_diff=abs(a - b),
                                    recorded=a, rescored=b))
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
            return SessionComparison(outcome="differs", differences=located([Difference(
                kind="field", key="status", recorded=recorded.status,
                detail=f"a {recorded.status} member carries scoring results",
            )]))
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
    rec_code = error_code(recorded.error) if recorded.status == "failed" else None
    res_code = error_code(rescored.error) if rescored.status == "failed" else None
    if recorded.status == "scored" and rescored.status == "scored":
        if recorded.turns != rescored.turns:
            diffs.append(_first_turn_difference(recorded, rescored))
        diffs += _compare_branches(recorded, rescored, scope, tol)
        diffs += _compare_stats(recorded.stats, rescored.stats, scope, tol)
        if not scope.complete:
            inconclusive = True
            notes.append(f"scorers {sorted(scope.not_rescored)} are non-deterministic: checked against the "
                         "verdict's own record, not re-run")
    elif recorded.status == "failed" and rescored.status == "failed":
        if rec_code != res_code:
            if res_code == "scorer_timeout":
                inconclusive = True
                notes.append(f"re-scoring timed out; the verdict recorded {rec_code}")
            else:
                diffs.append(Difference(kind="status", recorded=recorded.error, rescored=rescored.error,
                                        detail=f"failed with {rec_code} in the verdict, {res_code} when re-scored"))
    elif recorded.status == "scored":  # re-scoring failed
        if res_code == "scorer_timeout":
            inconclusive = True
            notes.append("re-scoring timed out (raise --timeout); the verdict recorded a scored member")
        else:
            diffs.append(Difference(kind="status", recorded="scored", rescored=rescored.error,
                                    scorer=_failed_scorer(rescored.error),
                                    detail="scored in the verdict, rejected when re-scored"))
    else:  # recorded failed, re-scoring succeeded
        culprit = _failed_scorer(recorded.error)
        if rec_code == "scorer_timeout":
            inconclusive = True
            notes.append("the verdict recorded a timeout; re-scoring succeeded (timeouts depend on load)")
        elif not scope.complete and (culprit is None or culprit in scope.not_rescored):
            inconclusive = True
            notes.append(f"the recorded failure ({rec_code}) may come from a non-re-scored scorer "
                         f"({culprit or 'unknown'}); the re-scored scorers succeeded")
        else:
            diffs.append(Difference(kind="status", recorded=recorded.error, rescored="scored", scorer=culprit,
                                    detail=f"failed with {rec_code} in the verdict, scored when re-scored"))
    if diffs:
        return SessionComparison(outcome="differs", differences=located(diffs), notes=notes)
    return SessionComparison(outcome="not_rescorable" if inconclusive else "identical", notes=notes)


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
            diffs.append(Difference(kind="verdict", recorded=len(verdict.sessions), rescored=verdict.group_size,
                                    detail="accepted with a member count different from group_size"))
    elif verdict.status == "rejected" and not verdict.reason:
        diffs.append(Difference(kind="verdict", detail="rejected without a reason"))
    elif verdict.status == "discarded" and set(statuses) - {"discarded"}:
        diffs.append(Difference(kind="verdict", detail=f"discarded with member statuses {dict(statuses)}"))
    return diffs


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
            local.append(Difference(kind="scorers", recorded=[f"{s.name}@{s.version}" for s in verdict.scorers],
                                    rescored=[f"{n}@{v}" for n, v in configured],
                                    detail="the verdict was scored by other scorers (names@versions) than configured"))
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
    by_version: dict[int, list[GroupVerdict]] = {}
    for verdict, _copies in variants:
        by_version.setdefault(verdict.verdict_version, []).append(verdict)
    conflicts: list[Difference] = []
    for version, found in sorted(by_version.items()):
        if len(found) > 1:
            head = found[0]
            fields = sorted({f for other in found[1:] for f in head.__struct_fields__
                             if getattr(head, f) != getattr(other, f)})
            conflicts.append(Difference(
                kind="conflicting_verdicts", verdict_version=version, recorded=len(found),
                detail=f"{len(found)} different verdicts for ({group_id!r}, version {version}); "
                       f"fields that differ: {', '.join(fields)}",
            ))
    diffs = conflicts + diffs  # group-level first: never cut by max_differences
    listed = {s.trajectory_id for verdict, _ in variants for s in verdict.sessions}
    unlisted = sorted(set(trajectories_seen) - listed)
    if unlisted:
        all_notes.append(f"trajectories on the topic but in no verdict of the group (late or extra members): "
                         f"{unlisted[:20]}")
    if diffs:
        outcome: GroupOutcome = "differs"
    elif missing:
        outcome = "verdict_without_trajectory"
    elif inconclusive:
        outcome = "not_rescorable"
    else:
        outcome = "identical"
    magnitudes = [d.max_abs_diff for d in diffs if d.max_abs_diff is not None]
    first = variants[0][0] if variants else None
    dedup_notes = list(dict.fromkeys(all_notes))
    return GroupFinding(
        group_id=group_id,
        outcome=outcome,
        status=first.status if first else "",
        reason=first.reason if first else "",
        verdict_versions=sorted(by_version),
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
        records[0].group_id, variants, comparisons, scope=scope,
        trajectories_seen=rescored.keys() if trajectories_seen is None else trajectories_seen,
        discard_seen=discard_seen, max_differences=max_differences,
    )


# =========================================================================== re-scoring
def failure_code(exc: BaseException) -> str:
    """The member error code the worker records for a scoring failure (see worker.failure_code)."""
    if isinstance(exc, TimeoutError):
        return "scorer_timeout"
    code = getattr(exc, "reason", None)
    return code if isinstance(code, str) and code else "scorer_error"


async def rescore(runner: PRMRunner | None, traj: ReadyTrajectory, *, timeout_s: float | None) -> SessionResult:
    """Score ``traj`` the way the worker does and return the member result it would park.

    Mirrors ``Worker._score``: a tree that is not concat export fails with
    ``not_concat_export``; no runner means scoring is off (no rewards); a rejection or
    timeout fails the member with its reason code and no partial results. Timestamps
    (``scored_at``) are left at 0; they are not compared.
    """
    common: dict[str, Any] = {
        "session_id": traj.session_id, "trajectory_id": traj.trajectory_id, "outcome_reward": traj.outcome_reward,
        "is_eval": traj.is_eval, "policy_version": traj.policy_version, "created_at": traj.created_at,
    }
    try:
        common["turns"] = compact_turns(traj.interactions)
    except NotConcatExport as exc:
        return SessionResult(status="failed", error=f"not_concat_export: {exc}", **common)
    if runner is None:
        return SessionResult(status="scored", **common)
    try:
        async with asyncio.timeout(timeout_s):
            scored = await runner.run(traj, is_eval=traj.is_eval)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the member fails, like in the worker
        common["turns"] = []
        detail = str(exc) or type(exc).__name__
        return SessionResult(status="failed", error=f"{failure_code(exc)}: {detail}"[:2000], **common)
    return SessionResult(
        status="scored",
        branches=scored.to_branch_results(),
        turn_results=[tr for b in scored.branches for tr in b.turn_results],
        stats=scored.stats("eval-rollout" if traj.is_eval else "rollout"),
        **common,
    )


async def build_runners(
    prm: PRMConfig, *, allowed_prefixes: Sequence[str] | None = None
) -> tuple[ScoringScope, PRMRunner | None, list[PRMRunner]]:
    """``(scope, runner to re-score with, runners to close)`` for the configured scorers.

    All configured scorers are built as the worker builds them (same
    ``allowed_prefixes``: ``worker.allowed_scorer_modules``) to learn which are
    deterministic. When some are not, re-scoring uses a second runner that borrows only
    the deterministic instances, so a sampling judge is never called.
    """
    if not prm.active:
        return ScoringScope(enabled=False), None, []
    from scoring_workers.prm import PRMRunner

    full = await PRMRunner.create(prm, allowed_prefixes=allowed_prefixes)
    try:
        active = [s for s in full.scorers if s.enabled]
        det = [s for s in active if scorer_is_deterministic(s)]
        skipped = [s.name for s in active if not scorer_is_deterministic(s)]
        scope = ScoringScope(enabled=True, scorers=tuple(full.scorer_infos()),
                             rescored=frozenset(s.name for s in det), not_rescored=frozenset(skipped))
        if not skipped:
            return scope, full, [full]
        partial = await PRMRunner.create(
            PRMConfig(enabled=True, scorers=det, advantage_shaping=prm.advantage_shaping)  # type: ignore[arg-type]
        )
    except BaseException:
        await full.aclose()
        raise
    return scope, partial, [partial, full]


@dataclass
class AuditReport:
    """What an audit found: one :class:`GroupFinding` per group plus counts."""

    findings: list[GroupFinding]
    scope: ScoringScope
    records: dict[str, int] = field(default_factory=dict)
    resume_offsets: str = ""

    @property
    def counts(self) -> dict[str, int]:
        counts = Counter(f.outcome for f in self.findings)
        return {outcome: counts.get(outcome, 0) for outcome in GROUP_OUTCOMES}

    @property
    def sessions(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for f in self.findings:
            total.update(f.sessions)
        return dict(sorted(total.items()))

    @property
    def exit_code(self) -> int:
        return 1 if self.counts["differs"] else 0

    def by_group(self) -> dict[str, GroupFinding]:
        return {f.group_id: f for f in self.findings}


class Auditor:
    """Bookkeeping of one audit, independent of Kafka.

    Feed every verdict record first (:meth:`feed_verdict`), then stream trajectory
    records (:meth:`feed_trajectory`); each trajectory a verdict member references is
    re-scored once (the first record of a ``trajectory_id`` wins, as in the worker) and
    compared at once against every distinct verdict listing it, so trajectories are not
    kept in memory. :meth:`finish` waits for re-scoring and returns the report.
    """

    def __init__(
        self,
        *,
        scope: ScoringScope,
        runner: PRMRunner | None,
        tol: Tolerance = DEFAULT_TOLERANCE,
        groups: Iterable[str] | None = None,
        timeout_s: float | None = 60.0,
        concurrency: int = 16,
        max_differences: int = 100,
        on_rescored: Callable[[int], None] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.scope, self.runner, self.tol = scope, runner, tol
        self.groups = frozenset(groups) if groups else None
        self.timeout_s, self.concurrency, self.max_differences = timeout_s, concurrency, max_differences
        self.on_rescored = on_rescored
        self.counts: Counter[str] = Counter()
        self._variants: dict[str, list[list[Any]]] = {}  # group -> [[verdict, copies]]
        self._refs: dict[str, list[tuple[str, int, int]]] = {}  # trajectory id -> (group, variant, session idx)
        self._results: dict[tuple[str, int, int], SessionComparison] = {}
        self._rescored: dict[str, bytes] = {}  # trajectory id -> digest of the record re-scored
        self._seen: dict[str, set[str]] = {}  # group -> trajectory ids on the topic
        self._discards: set[str] = set()
        self._notes: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._frozen = False

    # ------------------------------------------------------------------ verdicts
    def wanted(self, group_id: str) -> bool:
        return self.groups is None or group_id in self.groups

    def feed_verdict(self, value: bytes | None, headers: Any) -> GroupVerdict | None:
        """Decode and register one verdict record (skipped when filtered or undecodable)."""
        if self._frozen:
            raise RuntimeError("feed every verdict before the first trajectory")
        self.counts["verdict_records"] += 1
        try:
            verdict = decode_verdict(value, headers)
        except SchemaError:
            self.counts["undecodable_verdicts"] += 1
            return None
        if not self.wanted(verdict.group_id):
            return None
        self.add_verdict(verdict)
        return verdict

    def add_verdict(self, verdict: GroupVerdict) -> None:
        variants = self._variants.setdefault(verdict.group_id, [])
        for entry in variants:
            if entry[0] == verdict:
                entry[1] += 1
                return
        variants.append([verdict, 1])
        v = len(variants) - 1
        for j, session in enumerate(verdict.sessions):
            if session.status in ("scored", "failed"):
                self._refs.setdefault(session.trajectory_id, []).append((verdict.group_id, v, j))

    @property
    def sessions_to_rescore(self) -> int:
        """Distinct trajectories the registered verdicts need re-scored."""
        return len(self._refs)

    # ------------------------------------------------------------------ trajectories
    async def feed_trajectory(self, value: bytes | None, headers: Any) -> None:
        """Decode one trajectories-topic record; re-score it if a verdict needs it.

        Waits while ``concurrency`` re-scorings are in flight (backpressure on reading).
        """
        self._frozen = True
        self.counts["trajectory_records"] += 1
        try:
            message = decode_message(value, headers)
        except SchemaError:
            self.counts["undecodable_trajectories"] += 1  # the worker dead-lettered these
            return
        if not self.wanted(message.group_id):
            return
        if isinstance(message, DiscardGroup):
            self._discards.add(message.group_id)
            return
        self.add_trajectory_seen(message)
        tid = message.trajectory_id
        if tid not in self._refs:
            return
        digest = hashlib.blake2b(value or b"", digest_size=16).digest()
        first = self._rescored.get(tid)
        if first is not None:
            if first != digest:
                self._notes.setdefault(message.group_id, []).append(
                    f"trajectory {tid!r} was published again with a different payload; the first record "
                    "(the one the worker scored) was audited"
                )
            return
        self._rescored[tid] = digest
        while len(self._tasks) >= self.concurrency:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            self._reap()
        task = asyncio.create_task(self._rescore_and_compare(message))
        self._tasks.add(task)

    def add_trajectory_seen(self, traj: ReadyTrajectory) -> None:
        self._seen.setdefault(traj.group_id, set()).add(traj.trajectory_id)

    def _reap(self) -> None:
        for task in [t for t in self._tasks if t.done()]:
            self._tasks.discard(task)
            task.result()  # a bug in the audit itself must not pass silently

    async def _rescore_and_compare(self, traj: ReadyTrajectory) -> None:
        result = await rescore(self.runner, traj, timeout_s=self.timeout_s)
        for group_id, v, j in self._refs[traj.trajectory_id]:
            recorded = self._variants[group_id][v][0].sessions[j]
            self._results[(group_id, v, j)] = compare_session(recorded, result, scope=self.scope, tol=self.tol)
        if self.on_rescored is not None:
            self.on_rescored(1)

    # ------------------------------------------------------------------ report
    async def finish(self, *, resume_offsets: str = "") -> AuditReport:
        try:
            if self._tasks:
                await asyncio.wait(self._tasks)
            self._reap()
        except BaseException:
            for task in self._tasks:
                task.cancel()
            raise
        findings: list[GroupFinding] = []
        for group_id, variants in self._variants.items():
            comparisons = [
                [
                    self._results.get((group_id, v, j))
                    or compare_session(s, None, scope=self.scope, tol=self.tol)
                    for j, s in enumerate(verdict.sessions)
                ]
                for v, (verdict, _copies) in enumerate(variants)
            ]
            findings.append(summarize_group(
                group_id, [(verdict, copies) for verdict, copies in variants], comparisons, scope=self.scope,
                trajectories_seen=self._seen.get(group_id, ()), discard_seen=group_id in self._discards,
                max_differences=self.max_differences, notes=self._notes.get(group_id, ()),
            ))
        for group_id in sorted((set(self._seen) | self._discards) - set(self._variants)):
            findings.append(GroupFinding(
                group_id=group_id, outcome="trajectory_without_verdict",
                trajectories=sorted(self._seen.get(group_id, ())),
                notes=["a DiscardGroup record but no verdict"] if group_id in self._discards else [],
            ))
        findings.sort(key=lambda f: f.group_id)
        return AuditReport(findings=findings, scope=self.scope, records=dict(self.counts),
                           resume_offsets=resume_offsets)


# =========================================================================== Kafka
def parse_offsets(text: str | Iterable[str], *, aliases: Mapping[str, str] | None = None) -> dict[str, dict[int, int]]:
    """``"topic:partition:offset,..."`` -> ``{topic: {partition: offset}}``.

    ``aliases`` maps short names (``trajectories``, ``verdicts``) to topic names.
    """
    items = [text] if isinstance(text, str) else list(text)
    out: dict[str, dict[int, int]] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            try:
                topic, partition, offset = part.rsplit(":", 2)
                p, o = int(partition), int(offset)
            except ValueError:
                raise ValueError(f"bad offset {part!r}: expected TOPIC:PARTITION:OFFSET") from None
            if p < 0 or o < 0 or not topic:
                raise ValueError(f"bad offset {part!r}: partition and offset must be >= 0")
            topic = (aliases or {}).get(topic, topic)
            out.setdefault(topic, {})[p] = o
    return out


async def read_snapshot(
    cfg: PipelineConfig,
    topic: str,
    *,
    start: Mapping[int, int] | None = None,
    since_ms: int | None = None,
    on_total: Callable[[int], None] | None = None,
    ends_out: dict[int, int] | None = None,
) -> AsyncIterator[Any]:
    """Every record of ``topic`` up to the end each partition had when reading began.

    A group-less consumer (nothing committed, no group joined) starts each partition at
    ``start[partition]``, else at the first record at/after ``since_ms``, else at the
    beginning; records older than ``since_ms`` are skipped. The end of a partition is
    the first ``highwater()`` seen after a fetch (the embedded broker's ``end_offsets``
    is wrong), so records produced while the audit runs are left for the next one.
    ``on_total`` receives the number of records in range as partition ends become
    known; ``ends_out`` receives ``{partition: end}`` (for ``--from-offsets`` later).
    """
    from aiokafka.structs import TopicPartition

    from infra.kafka import make_consumer
    from prm_pipeline.verdict_dump import seek_to_time

    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    try:
        if topic not in await consumer.topics():
            raise AuditError(f"topic {topic!r} does not exist on {cfg.kafka.bootstrap}")
        partitions = consumer.partitions_for_topic(topic) or set()
        unknown = sorted(set(start or {}) - partitions)
        if unknown:
            raise AuditError(f"--from-offsets names partitions {unknown} of {topic!r}, which has {sorted(partitions)}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        if since_ms is not None:
            await seek_to_time(consumer, tps, since_ms)
        for tp in tps:
            if start and tp.partition in start:
                consumer.seek(tp, start[tp.partition])
        first = {tp: await consumer.position(tp) for tp in tps}
        ends: dict[Any, int] = {}
        done: set[Any] = set()
        stall_s = max(30.0, cfg.kafka.request_timeout_ms / 1000 * 2)
        last_progress = time.monotonic()
        while len(done) < len(tps):
            batch = await consumer.getmany(timeout_ms=200, max_records=1000)
            if batch or len(ends) < len(tps) and any(consumer.highwater(tp) is not None for tp in tps if tp not in ends):
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > stall_s:
                stuck = sorted(tp.partition for tp in tps if tp not in done)
                raise AuditError(f"no progress reading {topic!r} partitions {stuck} for {stall_s:.0f}s "
                                 "(broker unreachable, or it reports no high watermark)")
            for tp in tps:
                if tp not in ends and (high := consumer.highwater(tp)) is not None:
                    ends[tp] = max(high, first[tp])
                    if ends_out is not None:
                        ends_out[tp.partition] = ends[tp]
                    if on_total is not None:
                        on_total(ends[tp] - first[tp])
            for tp, records in batch.items():
                end = ends.get(tp)
                for record in records:
                    if end is not None and record.offset >= end:
                        break
                    if since_ms is not None and record.timestamp < since_ms:
                        yield None  # counted for progress, not audited
                        continue
                    yield record
            for tp in tps:
                if tp not in done and tp in ends and await consumer.position(tp) >= ends[tp]:
                    done.add(tp)
                    consumer.pause(tp)
    finally:
        await consumer.stop()


# =========================================================================== running it
@dataclass
class AuditOptions:
    """Options of one audit (the CLI flags; see :func:`add_audit_parser`)."""

    since_ms: int | None = None
    from_offsets: Mapping[str, Mapping[int, int]] | None = None
    groups: Sequence[str] | None = None
    out: str | None = None
    tolerance: Tolerance = DEFAULT_TOLERANCE
    concurrency: int = 16
    timeout_s: float | None = None  # default: worker.scorer_timeout_s
    max_differences: int = 100
    progress: bool | None = None  # None: when stderr is a terminal
    show: int = 10  # differing groups listed in the summary


def _progress(stderr: IO[str], enabled: bool | None) -> Any:  # rich types stay local to this function
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:,.0f}/s", style="progress.data.speed")

    console = Console(file=stderr, stderr=stderr is sys.stderr)
    if enabled is None:
        enabled = console.is_terminal
    return Progress(
        TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), RateColumn(),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console, disable=not enabled,
        refresh_per_second=5,
    )


def render_summary(report: AuditReport, out: IO[str], *, show: int = 10) -> None:
    """The end-of-audit tables: group outcomes, member outcomes, the first differing groups."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out, width=max(100, getattr(out, "columns", 0) or 0), soft_wrap=False)
    scope = report.scope
    counts = report.counts
    table = Table(title="audit summary (groups)")
    table.add_column("outcome")
    table.add_column("groups", justify="right")
    for outcome in GROUP_OUTCOMES:
        style = "bold red" if outcome == "differs" and counts[outcome] else None
        table.add_row(outcome.replace("_", " "), str(counts[outcome]), style=style)
    console.print(table)
    sessions = report.sessions
    if sessions:
        console.print("members: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sessions.items()))
    r = report.records
    console.print(
        f"records read: {r.get('verdict_records', 0)} verdicts, {r.get('trajectory_records', 0)} trajectories"
        + (f"; undecodable: {r.get('undecodable_verdicts', 0)} verdicts, "
           f"{r.get('undecodable_trajectories', 0)} trajectories"
           if r.get("undecodable_verdicts") or r.get("undecodable_trajectories") else "")
    )
    if not scope.enabled:
        console.print("scoring is disabled in the config: verdicts are expected to carry no rewards")
    elif scope.not_rescored:
        console.print(f"not re-run (non-deterministic): {', '.join(sorted(scope.not_rescored))}")
    differing = [f for f in report.findings if f.outcome == "differs"]
    if differing and show > 0:
        detail = Table(title=f"differing groups (first {min(show, len(differing))} of {len(differing)})")
        for name in ("group", "kind", "session", "turn", "scorer", "max |diff|"):
            detail.add_column(name, overflow="fold")
        for finding in differing[:show]:
            located = [d for d in finding.differences if d.session_id or d.turn]
            d = (located or finding.differences or [Difference(kind="verdict")])[0]
            detail.add_row(
                finding.group_id, d.kind, d.session_id or "", d.turn or "", d.scorer or "",
                "" if finding.max_abs_diff is None else f"{finding.max_abs_diff:.6g}",
            )
        console.print(detail)
    if report.resume_offsets:
        console.print(f"next audit from here: --from-offsets {report.resume_offsets}", soft_wrap=True)


def write_findings(path: str, findings: Iterable[GroupFinding]) -> int:
    encoder = msgspec.json.Encoder()
    n = 0
    with open(path, "wb") as fh:
        for finding in findings:
            fh.write(encoder.encode(finding) + b"\n")
            n += 1
    return n


async def audit(
    cfg: PipelineConfig,
    options: AuditOptions | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> AuditReport:
    """Run one audit: read both topics, re-score, compare, write ``--out`` and the summary.

    Returns the :class:`AuditReport`; its ``exit_code`` is 1 when anything differs.
    """
    options = options or AuditOptions()
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    topics = cfg.topics
    offsets = {k: dict(v) for k, v in (options.from_offsets or {}).items()}
    stray = sorted(set(offsets) - {topics.trajectories, topics.verdicts})
    if stray:
        raise AuditError(f"--from-offsets names {stray}; only {topics.trajectories!r} and {topics.verdicts!r} "
                         "are audited")
    timeout_s = options.timeout_s if options.timeout_s is not None else cfg.worker.scorer_timeout_s
    scope, runner, owned = await build_runners(cfg.prm, allowed_prefixes=cfg.worker.allowed_scorer_modules)
    try:
        progress = _progress(stderr, options.progress)
        with progress:
            verdict_task = progress.add_task("reading verdicts", total=0)
            rescore_task = progress.add_task("re-scoring", total=None, start=False)
            traj_task = progress.add_task("reading trajectories", total=0)
            auditor = Auditor(
                scope=scope, runner=runner, tol=options.tolerance, groups=options.groups, timeout_s=timeout_s,
                concurrency=options.concurrency, max_differences=options.max_differences,
                on_rescored=lambda n: progress.advance(rescore_task, n),
            )

            def grow(task: Any) -> Callable[[int], None]:
                return lambda n: progress.update(task, total=(progress.tasks[task].total or 0) + n)

            ends: dict[str, dict[int, int]] = {topics.verdicts: {}, topics.trajectories: {}}
            async for record in read_snapshot(cfg, topics.verdicts, start=offsets.get(topics.verdicts),
                                              since_ms=options.since_ms, on_total=grow(verdict_task),
                                              ends_out=ends[topics.verdicts]):
                progress.advance(verdict_task)
                if record is not None:
                    auditor.feed_verdict(record.value, record.headers)
            progress.update(rescore_task, total=auditor.sessions_to_rescore)
            progress.start_task(rescore_task)
            async for record in read_snapshot(cfg, topics.trajectories, start=offsets.get(topics.trajectories),
                                              since_ms=options.since_ms, on_total=grow(traj_task),
                                              ends_out=ends[topics.trajectories]):
                progress.advance(traj_task)
                if record is not None:
                    await auditor.feed_trajectory(record.value, record.headers)
            resume = ",".join(f"{t}:{p}:{o}" for t in (topics.trajectories, topics.verdicts)
                              for p, o in sorted(ends[t].items()))
            report = await auditor.finish(resume_offsets=resume)
            progress.update(rescore_task, total=progress.tasks[rescore_task].completed)
    finally:
        for r in owned:
            await r.aclose()
    if options.out:
        write_findings(options.out, report.findings)
    render_summary(report, stdout, show=options.show)
    return report


def run_audit(cfg: PipelineConfig, options: AuditOptions | None = None) -> int:
    """Synchronous entry point: run :func:`audit`, return the exit code (0, 1; 2 on error)."""
    try:
        report = asyncio.run(audit(cfg, options))
    except AuditError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return report.exit_code


# =========================================================================== command line
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _tolerance(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def add_audit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``audit`` on the CLI's subparsers; ``func`` takes the Namespace, returns the exit code."""
    from prm_pipeline.verdict_dump import since_arg

    p = subparsers.add_parser(
        "audit",
        help="re-score recorded trajectories and compare with the recorded verdicts",
        description="Re-score every trajectory a recorded verdict names with the configured scorers and "
                    "compare. Reads prm.trajectories and prm.verdicts with group-less consumers (no offsets "
                    "committed, no Redis). Exit code 1 when anything differs. See docs/audit.md.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--since", type=since_arg, metavar="TIME", default=None,
                       help="only records timestamped at/after TIME: ISO-8601 (2026-11-30T14:05Z) or an age "
                            "(15m, 2h, 1d)")
    where.add_argument("--from-offsets", action="append", metavar="TOPIC:PARTITION:OFFSET,...", default=None,
                       help="start partitions at these offsets (others from the beginning); TOPIC may be "
                            "'trajectories' or 'verdicts'; repeatable")
    p.add_argument("--groups", nargs="+", metavar="ID", default=None,
                   help="audit only these group ids (space- or comma-separated)")
    p.add_argument("--out", metavar="FILE", default=None, help="write one JSON line per group to FILE")
    p.add_argument("--rtol", type=_tolerance, default=RTOL, metavar="R", help=f"relative tolerance (default {RTOL:g})")
    p.add_argument("--atol", type=_tolerance, default=ATOL, metavar="A", help=f"absolute tolerance (default {ATOL:g})")
    p.add_argument("--concurrency", type=_positive_int, default=16, metavar="N", help="trajectories re-scored at once (16)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="per-trajectory re-scoring timeout (default worker.scorer_timeout_s)")
    p.add_argument("--max-differences", type=_positive_int, default=100, metavar="N",
                   help="differences kept per group in --out (100)")
    p.add_argument("--show", type=int, default=10, metavar="N", help="differing groups listed in the summary (10)")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, default=None,
                   help="no progress bar (default: shown when stderr is a terminal)")
    p.set_defaults(func=cmd_audit)
    return p


def options_from_args(args: argparse.Namespace, cfg: PipelineConfig) -> AuditOptions:
    aliases = {"trajectories": cfg.topics.trajectories, "verdicts": cfg.topics.verdicts}
    groups = None
    if args.groups:
        groups = [g for item in args.groups for g in item.split(",") if g]
    return AuditOptions(
        since_ms=args.since,
        from_offsets=parse_offsets(args.from_offsets, aliases=aliases) if args.from_offsets else None,
        groups=groups,
        out=args.out,
        tolerance=Tolerance(rtol=args.rtol, atol=args.atol),
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        max_differences=args.max_differences,
        progress=args.progress,
        show=args.show,
    )


def cmd_audit(args: argparse.Namespace) -> int:
    """``prm-pipeline audit``: exit 0 when nothing differs, 1 when something does, 2 on errors."""
    from infra.config import load_config

    cfg = load_config(getattr(args, "config", None))
    try:
        options = options_from_args(args, cfg)
    except ValueError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    code = run_audit(cfg, options)
    print(f"audit finished in {time.monotonic() - started:.1f}s (exit {code})", file=sys.stderr)
    return code
