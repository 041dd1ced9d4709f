"""Where the tests' Kafka and Redis come from.

Order (docs/architecture.md describes the parts): an existing service named by ``PRM_TEST_KAFKA`` /
``PRM_TEST_REDIS`` > testcontainers when a Docker daemon answers > the embedded
binaries of :mod:`infra.local`. Each of Kafka and Redis is chosen on its own, so
``PRM_TEST_REDIS`` alone pairs a real Redis with the embedded broker.

Caveats of the embedded broker (tansu 0.6) that shape our tests:
- One broker per test *session*: its memory engine never frees data, so tests get
  unique topic names instead of a fresh broker.
- Consumer-group joins wait half the session timeout, and a LeaveGroup from the group
  leader mid-rebalance stalls the group: tests use ``infra.local.LOCAL_BROKER_CLIENT``
  (2 s sessions, members leave by session expiry).
- ``end_offsets``/``seek_to_end`` are wrong: tests read with ``highwater()`` or to a
  known count with a deadline, never "to the end".
- No idempotent producer / transactions: nothing here may require them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

Backend = Literal["env", "testcontainers", "embedded"]


def docker_available() -> bool:
    """True when a Docker daemon answers within ~2 s (testcontainers needs one)."""
    try:
        import docker

        client = docker.from_env(timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - no client library, no socket, no daemon: all "no"
        return False


def choose_backend(
    service: Literal["kafka", "redis"], environ: Mapping[str, str], docker_probe: Callable[[], bool]
) -> Backend:
    if environ.get(f"PRM_TEST_{service.upper()}"):
        return "env"
    if docker_probe():
        return "testcontainers"
    return "embedded"


@dataclass
class ServiceEndpoints:
    kafka_bootstrap: str
    redis_url: str
    kafka_backend: Backend
    redis_backend: Backend
    embedded: object | None = None  # infra.local.LocalStack when used


@contextlib.contextmanager
def start_test_services(
    environ: Mapping[str, str], data_dir: str, docker_probe: Callable[[], bool] = docker_available
) -> Iterator[ServiceEndpoints]:
    """Start (or locate) Kafka and Redis for one test session."""
    probe_cache: list[bool] = []

    def probe() -> bool:  # ask the daemon once, whatever both services decide
        if not probe_cache:
            probe_cache.append(docker_probe())
        return probe_cache[0]

    kb, rb = choose_backend("kafka", environ, probe), choose_backend("redis", environ, probe)
    with contextlib.ExitStack() as stack:
        kafka = environ.get("PRM_TEST_KAFKA", "")
        redis = environ.get("PRM_TEST_REDIS", "")
        embedded = None
        if "embedded" in (kb, rb):
            from infra.local import LocalStack

            embedded = stack.enter_context(LocalStack(data_dir))
        if kb == "testcontainers":
            from testcontainers.kafka import KafkaContainer

            kafka = stack.enter_context(KafkaContainer().with_kraft()).get_bootstrap_server()
        if rb == "testcontainers":
            from testcontainers.redis import RedisContainer

            rc = stack.enter_context(RedisContainer())
            redis = f"redis://{rc.get_container_host_ip()}:{rc.get_exposed_port(6379)}/0"
        if kb == "embedded":
            kafka = embedded.kafka_bootstrap
        if rb == "embedded":
            redis = embedded.redis_url
        yield ServiceEndpoints(kafka, redis, kb, rb, embedded)
