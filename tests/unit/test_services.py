"""The fixture fallback order: env > testcontainers (Docker answers) > embedded."""

from __future__ import annotations

import pytest

from tests.services import choose_backend, start_test_services


def _no_docker() -> bool:
    return False


def _docker() -> bool:
    return True


def test_env_wins_over_docker() -> None:
    env = {"PRM_TEST_KAFKA": "k:9092", "PRM_TEST_REDIS": "redis://r/0"}
    assert choose_backend("kafka", env, _docker) == "env"
    assert choose_backend("redis", env, _docker) == "env"


def test_docker_when_no_env() -> None:
    assert choose_backend("kafka", {}, _docker) == "testcontainers"


def test_embedded_without_docker_or_env() -> None:
    assert choose_backend("redis", {}, _no_docker) == "embedded"


def test_each_service_chosen_on_its_own() -> None:
    env = {"PRM_TEST_REDIS": "redis://r/0"}
    assert choose_backend("redis", env, _no_docker) == "env"
    assert choose_backend("kafka", env, _no_docker) == "embedded"


def test_env_for_both_starts_nothing(tmp_path) -> None:
    probed: list[int] = []

    def probe() -> bool:
        probed.append(1)
        return True

    env = {"PRM_TEST_KAFKA": "kafka.example:9092", "PRM_TEST_REDIS": "redis://redis.example:6379/0"}
    with start_test_services(env, str(tmp_path), probe) as svc:
        assert (svc.kafka_bootstrap, svc.redis_url) == ("kafka.example:9092", "redis://redis.example:6379/0")
        assert svc.embedded is None
    assert probed == []  # the Docker daemon is not even asked


@pytest.mark.integration
def test_embedded_fallback_starts_real_servers(tmp_path) -> None:
    env = {"PRM_TEST_REDIS": "redis://elsewhere:6379/0"}
    with start_test_services(env, str(tmp_path), _no_docker) as svc:
        assert svc.kafka_backend == "embedded" and svc.redis_backend == "env"
        assert svc.redis_url == "redis://elsewhere:6379/0"
        assert svc.embedded is not None and svc.embedded.broker.running
    assert not svc.embedded.broker.running  # stopped on exit
