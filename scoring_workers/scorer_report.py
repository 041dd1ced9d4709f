"""What a worker says at start-up about the scorers it runs.

A worker with no active scorer still decides groups: every complete group gets an
``accepted`` verdict with no process rewards. That is legitimate (outcome-only
training) but is far more often a forgotten ``--config``, so it is a loud warning that
names the reason. With scorers, one line per scorer says what will actually score:
name, weight, version and the class imported (an AReaL example path may resolve to
the built-in alias, or to the user's own module).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from infra.config import PRMConfig

if TYPE_CHECKING:
    from scoring_workers.prm import ScoringRunner

__all__ = ["describe_scorers", "log_scorers", "no_scorer_reason"]


def no_scorer_reason(prm: PRMConfig) -> str:
    """Why ``prm`` runs no scorer (only meaningful when it runs none)."""
    if not prm.scorers:
        return "rollout.agent.prm.scorers is empty or absent (was the worker started without --config?)"
    if not prm.enabled:
        return "rollout.agent.prm.enabled is false"
    return "every entry of rollout.agent.prm.scorers has enabled: false"


def describe_scorers(runner: ScoringRunner | None, prm: PRMConfig) -> tuple[list[str], str | None]:
    """``(one line per built scorer, a warning when none will run)``.

    ``runner`` is a :class:`~scoring_workers.prm.PRMRunner` or any
    :class:`~scoring_workers.prm.ScoringRunner` (None when scoring is off).
    """
    scorers = list(runner.scorers) if runner is not None else []
    lines = []
    for scorer in scorers:
        cls = type(scorer)
        state = "active" if runner is not None and runner.active and scorer.enabled else "disabled"
        lines.append(
            f"scorer {scorer.name!r} ({state}): weight={scorer.weight:g} "
            f"version={getattr(scorer, 'version', '?')} class={cls.__module__}.{cls.__qualname__}"
        )
    warning = None
    if runner is None or not runner.active:
        warning = (
            f"NO SCORER IS ACTIVE: {no_scorer_reason(prm)}; every complete group will be "
            "accepted with no process rewards"
        )
    return lines, warning


def log_scorers(log: logging.Logger, worker_id: str, runner: ScoringRunner | None, prm: PRMConfig) -> None:
    """Log :func:`describe_scorers` for a worker starting up."""
    lines, warning = describe_scorers(runner, prm)
    for line in lines:
        log.info("worker %s: %s", worker_id, line)
    if warning is not None:
        log.warning("worker %s: %s", worker_id, warning)
