"""The PRM scorer contract and runner, under AReaL's names (seed 001).

Public API::

    BaseScorer, BaseTrajectoryScorer, PRMScorerResult     # write scorers
    PRMMetricObservation, PRMTurnResult                   # wire types (infra.schema)
    PRMRunner, ScoredTrajectory, ScoredBranch             # score trajectories
    PRMRejection, RunnerClosedError                       # what run() raises
    PRMConfig, PRMScorerConfig, PRMAdvantageShapingConfig # config (infra.config)

Importing this package stays light (torch, numpy, msgspec; no HTTP, Kafka or Redis
clients) so worker pods start fast; scorers that need clients import them themselves.
"""

from infra.config import PRMAdvantageShapingConfig, PRMConfig, PRMScorerConfig
from infra.schema import PRMMetricObservation, PRMTurnResult
from scoring_workers.prm.base import BaseScorer, BaseTrajectoryScorer, PRMScorerResult
from scoring_workers.prm.resolve import SCORER_ALIASES, build_scorer, resolve_scorer_class
from scoring_workers.prm.results import (
    REJECTION_REASONS,
    PRMRejection,
    RunnerClosedError,
    ScoredBranch,
    ScoredTrajectory,
    stats_namespace,
)
from scoring_workers.prm.runner import PRMRunner
from scoring_workers.prm.view import InteractionView

__all__ = [
    "BaseScorer",
    "BaseTrajectoryScorer",
    "InteractionView",
    "PRMAdvantageShapingConfig",
    "PRMConfig",
    "PRMMetricObservation",
    "PRMRejection",
    "PRMRunner",
    "PRMScorerConfig",
    "PRMScorerResult",
    "PRMTurnResult",
    "REJECTION_REASONS",
    "RunnerClosedError",
    "SCORER_ALIASES",
    "ScoredBranch",
    "ScoredTrajectory",
    "build_scorer",
    "resolve_scorer_class",
    "stats_namespace",
]
