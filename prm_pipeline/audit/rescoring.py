"""Re-scoring one trajectory the way the worker does, with the configured scorers.

:func:`build_runners` builds the configured scorers as the worker builds them and
decides, with :func:`scorer_is_deterministic`, which of them the audit may re-run
(a sampling judge is never re-called); :func:`rescore` calls the worker's own
:func:`~scoring_workers.scoring.score_member` and returns the member result the worker
would park. Kept apart from the comparison so
that :mod:`prm_pipeline.audit.compare` stays free of runners.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from infra.config import PRMConfig
from infra.schema import ReadyTrajectory, SessionResult
from prm_pipeline.audit.compare import ScoringScope
from scoring_workers.scoring import score_member

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
async def rescore(
    runner: PRMRunner | None, traj: ReadyTrajectory, *, timeout_s: float | None, keep_channels: bool = False
) -> SessionResult:
    """Score ``traj`` exactly as the worker does (:func:`score_member`) and return the member
    result it would park; ``scored_at`` is left at 0 (it is not compared)."""
    return await score_member(runner, traj, timeout_s=timeout_s, keep_channels=keep_channels, scored_at=0.0)


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
        scope = ScoringScope(
            enabled=True,
            scorers=tuple(full.scorer_infos()),
            rescored=frozenset(s.name for s in det),
            not_rescored=frozenset(skipped),
        )
        if not skipped:
            return scope, full, [full]
        partial = await PRMRunner.create(
            PRMConfig(enabled=True, scorers=det, advantage_shaping=prm.advantage_shaping)  # type: ignore[arg-type]
        )
    except BaseException:
        await full.aclose()
        raise
    return scope, partial, [partial, full]
