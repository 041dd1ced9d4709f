"""``LengthBudgetScorer``: the example scorer of AReaL's Process Rewards docs, built in.

It rewards a turn ``1.0`` when it stays within ``max_output_tokens`` generated tokens
and ``0.0`` otherwise, and reports a boolean turn observation ``within_budget``
(aggregated as ``count`` and ``rate``). It needs nothing but the token count, so it is
also the reference for measuring the runner's own overhead
(``python -m tests.perf.bench_runner``).

AReaL's example config path ``examples.prm.scorers.LengthBudgetScorer`` resolves here
when no user module of that name is importable (see :data:`scoring_workers.prm.resolve.SCORER_ALIASES`).
"""

from __future__ import annotations

import numbers
from typing import Any

from infra.config import ConfigError
from scoring_workers.prm import BaseScorer, PRMMetricObservation, PRMScorerResult
from scoring_workers.scorers.record_settings import LengthBudgetRecordSettings

__all__ = ["LengthBudgetScorer"]

_AGGREGATIONS = ("count", "rate")


class LengthBudgetScorer(BaseScorer):
    """``1.0`` if ``output_len <= max_output_tokens`` else ``0.0``; observes ``within_budget``."""

    name = "length_budget"
    version = "1"
    record_settings = LengthBudgetRecordSettings
    max_output_tokens: int
    streamable = True  # the turn's output length, nothing else (stream_key: None)

    def __init__(self, weight: float = 1.0, enabled: bool = True, max_output_tokens: int = 128) -> None:
        super().__init__(weight=weight, enabled=enabled)
        if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, numbers.Integral):
            raise TypeError(f"length_budget: max_output_tokens must be an integer, got {max_output_tokens!r}")
        if max_output_tokens <= 0:
            raise ConfigError(f"length_budget: max_output_tokens must be > 0, got {max_output_tokens}")
        self.max_output_tokens = int(max_output_tokens)

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return 1.0 if interaction.model_response.output_len <= self.max_output_tokens else 0.0

    def prepare_result(self, interaction: Any, result: Any, ctx: dict[str, Any]) -> PRMScorerResult | None:
        if result is None:
            return None
        within = PRMMetricObservation(
            metric_id="within_budget",
            scope="turn",
            target_id=interaction.interaction_id,
            value=interaction.model_response.output_len <= self.max_output_tokens,
            value_type="boolean",
            aggregations=_AGGREGATIONS,
        )
        if isinstance(result, PRMScorerResult):  # a subclass already attached observations
            return PRMScorerResult(result.reward, (*result.observations, within))
        return PRMScorerResult(result, (within,))
