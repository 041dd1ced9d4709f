"""The PRM scorer contract and runner, under AReaL's names (AReaL's Process Rewards).

Public API::

    BaseScorer, BaseTrajectoryScorer, PRMScorerResult     # write scorers
    PRMMetricObservation, PRMTurnResult                   # wire types (infra.schema)
    PRMRunner, ScoredTrajectory, ScoredBranch             # score trajectories
    failure_code, failure_detail, PRMErrorContext         # what a failed run() says
    RunnerClosedError                                     # run() after aclose()
    PRMConfig, PRMScorerConfig, PRMAdvantageShapingConfig # config (infra.config)

Importing this package stays light (torch, numpy, msgspec; no HTTP, Kafka or Redis
clients) so worker pods start fast; scorers that need clients import them themselves.
"""

from infra.config import PRMAdvantageShapingConfig, PRMConfig, PRMScorerConfig
from infra.schema import PRMMetricObservation, PRMTurnResult
from scoring_workers.prm.base import BaseScorer, BaseTrajectoryScorer, PRMScorerResult
from scoring_workers.prm.errors import REJECTION_REASONS, PRMErrorContext, failure_code, failure_detail
from scoring_workers.prm.resolve import SCORER_ALIASES, build_scorer, resolve_scorer_class
from scoring_workers.prm.results import RunnerClosedError, ScoredBranch, ScoredTrajectory, stats_namespace
from scoring_workers.prm.runner import PRMRunner
from scoring_workers.prm.view import InteractionView

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
    "build_scorer",
    "failure_code",
    "failure_detail",
    "resolve_scorer_class",
    "stats_namespace",
]
