"""Re-scoring one trajectory the way the worker does, with the configured scorers.

:func:`build_runners` builds the configured scorers as the worker builds them and
decides, with :func:`scorer_is_deterministic`, which of them the audit may re-run
(a sampling judge is never re-called); :func:`rescore` mirrors ``Worker._score`` and
returns the member result the worker would park. Kept apart from the comparison so
that :mod:`prm_pipeline.audit.compare` stays free of runners.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from infra.config import PRMConfig
from infra.schema import (
    NotConcatExport,
    ReadyTrajectory,
    SessionResult,
    compact_turns,
)
from prm_pipeline.audit.compare import ScoringScope
from scoring_workers.prm.errors import failure_code, failure_detail

if TYPE_CHECKING:
    from scoring_workers.prm import PRMRunner


# =========================================================================== scorer determinism
def scorer_is_deterministic(scorer: Any) -> bool:
    """Whether re-running ``scorer`` on the same trajectory must give the same result.

    Scorers declare it with ``deterministic`` (``BaseScorer`` says True; the LLM judges
    make it a property that is True only at temperature 0; a callable is called).
    Re-calling a sampling judge would cost money and report noise as differences.
    """
    declared = getattr(scorer, "deterministic", True)
    return bool(declared() if callable(declared) else declared)


# =========================================================================== re-scoring


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
        detail = failure_detail(exc)
        return SessionResult(status="failed", error=f"{failure_code(exc)}: {detail}"[:2000], **common)
    return SessionResult(
        status="scored",
        branches=scored.to_branch_results(),
        turn_results=[tr for b in scored.branches for tr in b.turn_results],
        stats=scored.stats("eval-rollout" if traj.is_eval else "rollout"),
        error=scored.fallback,
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
            PRMConfig(enabled=True, scorers=det, advantage_shaping=prm.advantage_shaping,
                      error_policy=prm.error_policy)  # type: ignore[arg-type]
        )
    except BaseException:
        await full.aclose()
        raise
    return scope, partial, [partial, full]
