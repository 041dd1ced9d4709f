"""Shared fixtures: real Kafka-protocol broker and real Redis for integration tests.

``kafka_bootstrap`` and ``redis_url`` are session-scoped (one broker per run, see
tests/services.py for where they come from); ``pipeline_config`` gives each test its
own topic names, consumer groups and Redis key prefix so tests never see each
other's data.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from infra.config import PipelineConfig
from tests.integration.harness import isolated_config
from tests.services import ServiceEndpoints, start_test_services


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceEndpoints]:
    with start_test_services(os.environ, str(tmp_path_factory.mktemp("local-stack"))) as svc:
        yield svc


@pytest.fixture(scope="session")
def kafka_bootstrap(services: ServiceEndpoints) -> str:
    return services.kafka_bootstrap


@pytest.fixture(scope="session")
def redis_url(services: ServiceEndpoints) -> str:
    return services.redis_url


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short, test-specific name: topics and keys of one test never collide with another's."""
    return f"{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pipeline_config(kafka_bootstrap: str, redis_url: str, unique_name: str) -> PipelineConfig:
    """A config pointing at the test services with per-test topics, groups and key prefix (no scorers)."""
    return isolated_config(unique_name, kafka_bootstrap, redis_url, scorer_timeout_s=10, group_timeout_s=30)
