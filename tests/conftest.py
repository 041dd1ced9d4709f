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

from infra.config import KafkaConfig, PipelineConfig, RedisConfig, TopicsConfig, WorkerConfig
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
    """A config pointing at the test services with per-test topics, groups and key prefix.

    Session/heartbeat timeouts are short because the embedded broker makes group joins
    wait half the session timeout.
    """
    return PipelineConfig(
        kafka=KafkaConfig(
            bootstrap=kafka_bootstrap,
            session_timeout_ms=2000,
            heartbeat_interval_ms=500,
            linger_ms=1,
        ),
        redis=RedisConfig(url=redis_url, key_prefix=f"prm-test:{unique_name}", ttl_s=600),
        topics=TopicsConfig(
            trajectories=f"traj.{unique_name}",
            verdicts=f"verd.{unique_name}",
            dead_letters=f"dlq.{unique_name}",
            partitions=4,
        ),
        worker=WorkerConfig(group_id=f"workers.{unique_name}", scorer_timeout_s=10, group_timeout_s=30,
                            allowed_scorer_modules=["scoring_workers.scorers", "tests.scorers"]),
    )
