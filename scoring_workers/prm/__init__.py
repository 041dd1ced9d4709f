"""The PRM scorer contract and runner, under AReaL's names (AReaL's Process Rewards).

Public API::

    BaseScorer, BaseTrajectoryScorer, PRMScorerResult     # write scorers
    PRMMetricObservation, PRMTurnResult                   # wire types (infra.schema)
    PRMRunner, ScoredTrajectory, ScoredBranch             # score trajectories
    ScoringRunner                                         # what holders of a runner use of it
    failure_code, failure_detail, PRMErrorContext         # what a failed run() says
    RunnerClosedError                                     # run() after aclose()
    PRMConfig, PRMScorerConfig, PRMAdvantageShapingConfig # config (infra.config)

Importing this package stays light (numpy, msgspec; no HTTP, Kafka or Redis clients)
so worker pods start fast; scorers that need clients import them themselves. torch
comes with :class:`PRMRunner`, imported on first use: a command that only checks a
config (``prm-pipeline`` before it connects) starts without it.
"""

from typing import TYPE_CHECKING

from infra.config import PRMAdvantageShapingConfig, PRMConfig, PRMScorerConfig
from infra.schema import PRMMetricObservation, PRMTurnResult
from scoring_workers.prm.base import BaseScorer, BaseTrajectoryScorer, PRMScorerResult
from scoring_workers.prm.errors import REJECTION_REASONS, PRMErrorContext, failure_code, failure_detail
from scoring_workers.prm.protocols import ScoringRunner
from scoring_workers.prm.resolve import SCORER_ALIASES, build_scorer, resolve_scorer_class
from scoring_workers.prm.results import RunnerClosedError, ScoredBranch, ScoredTrajectory, stats_namespace
from scoring_workers.prm.view import InteractionView

if TYPE_CHECKING:
    from scoring_workers.prm.runner import PRMRunner


def __getattr__(name: str) -> object:
    if name == "PRMRunner":  # the runner imports torch: loaded when first asked for
        from scoring_workers.prm.runner import PRMRunner

        return PRMRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BaseScorer",
    "BaseTrajectoryScorer",
    "InteractionView",
    "PRMAdvantageShapingConfig",
    "PRMConfig",
    "PRMErrorContext",
    "PRMMetricObservation",
    "PRMRunner",
    "PRMScorerConfig",
    "PRMScorerResult",
    "PRMTurnResult",
    "REJECTION_REASONS",
    "RunnerClosedError",
    "SCORER_ALIASES",
    "ScoredBranch",
    "ScoredTrajectory",
    "ScoringRunner",
    "build_scorer",
    "failure_code",
    "failure_detail",
    "resolve_scorer_class",
    "stats_namespace",
]
