"""Scoring one group member: the single definition the worker and the audit both call.

:func:`score_member` turns a :class:`ReadyTrajectory` into the :class:`SessionResult`
the ledger parks. The audit (``prm-pipeline audit``) re-scores recorded trajectories
with this same function, so a verdict and its audit can only differ when the scorers'
outputs differ — never because two copies of the rules drifted apart.

Rules:
* a tree that is not concat export fails with ``not_concat_export`` (it cannot be
  trained on; verdicts carry the compact token turns);
* no runner means scoring is off: the member is ``scored`` without rewards;
* a scorer failure or a timeout fails the member with its reason code
  (:func:`scoring_workers.prm.errors.failure_code`) and keeps no partial results or turns;
* ``keep_channels`` (``worker.keep_scorer_channels``) keeps each scorer's own token
  rewards in the branches.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from infra.schema import NotConcatExport, ReadyTrajectory, SessionResult, compact_turns, expand_trajectory
from scoring_workers.prm.errors import error_context, failure_code, failure_detail

if TYPE_CHECKING:
    from scoring_workers.prm import ScoringRunner
    from scoring_workers.prm.streamed import Reuse


def _failed_scorer(exc: BaseException) -> str | None:
    """The scorer a run's exception names: the runner's context, else the judges' own attribute."""
    context = error_context(exc)
    if context is not None and context.scorer_name:
        return context.scorer_name
    return getattr(exc, "scorer_name", None)


async def score_member(
    runner: ScoringRunner | None,
    traj: ReadyTrajectory,
    *,
    timeout_s: float | None,
    keep_channels: bool = False,
    scored_at: float | None = None,
    reuse: Reuse | None = None,
) -> SessionResult:
    """Score ``traj`` and return the member result to park (see the module rules).

    ``scored_at`` defaults to now (the worker); the audit passes 0 (it is not compared).
    A compact trajectory (the worker decodes the wire form and checks it with
    :func:`infra.schema.check_expandable`) gives its token turns without any prefix
    comparison, then is expanded: scorers see full turns. ``reuse``: a streamed session's
    turn results computed before it ended (:mod:`scoring_workers.prm.streamed`).
    """
    not_concat: NotConcatExport | None
    try:
        turns = compact_turns(traj.interactions)
    except NotConcatExport as exc:
        turns, not_concat = [], exc
    else:
        not_concat = None
    traj = expand_trajectory(traj)
    common: dict[str, Any] = {
        "session_id": traj.session_id,
        "trajectory_id": traj.trajectory_id,
        "outcome_reward": traj.outcome_reward,
        "is_eval": traj.is_eval,
        "policy_version": traj.policy_version,
        "created_at": traj.created_at,
    }

    def stamp() -> float:
        return time.time() if scored_at is None else scored_at

    common["turns"] = turns
    if not_concat is not None:
        return SessionResult.failure(code="not_concat_export", detail=str(not_concat), scored_at=stamp(), **common)
    if runner is None:
        return SessionResult(status="scored", scored_at=stamp(), **common)
    try:
        async with asyncio.timeout(timeout_s):
            extra: dict[str, Any] = {"keep_channels": True} if keep_channels else {}
            if reuse is not None:
                extra["reuse"] = reuse
            scored = await runner.run(traj, is_eval=traj.is_eval, **extra)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the member fails; the group will be rejected
        common["turns"] = []
        detail = failure_detail(exc)
        return SessionResult.failure(
            code=failure_code(exc), detail=detail, scorer=_failed_scorer(exc), scored_at=stamp(), **common
        )
    return SessionResult(
        status="scored",
        branches=scored.to_branch_results(),
        turn_results=[tr for b in scored.branches for tr in b.turn_results],
        stats=scored.stats("eval-rollout" if traj.is_eval else "rollout"),
        error=scored.fallback,  # error_policy keep_original: what failed (None otherwise)
        scored_at=stamp(),
        **common,
    )
