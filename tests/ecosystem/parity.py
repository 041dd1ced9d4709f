"""The ecosystem tests' pipeline: an isolated config scored by ``TokenParityScorer``, whose
rewards (+0.5 per even token id, -0.25 per odd one) a test can compute by hand."""

from __future__ import annotations

import uuid

from infra.config import PipelineConfig, PRMScorerConfig
from tests.integration.harness import TEST_SCORER_MODULES, isolated_config


def parity_config(name: str, kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return isolated_config(
        f"{name}-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        scorer_timeout_s=5,
        group_timeout_s=10,
        allowed_scorer_modules=[*TEST_SCORER_MODULES, "tests.ecosystem"],
        scorers=[PRMScorerConfig("tests.ecosystem.scorers.TokenParityScorer")],
    )
