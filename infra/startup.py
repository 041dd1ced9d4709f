"""Waiting for Kafka and Redis at startup, and saying in one line when they never came.

Every command that needs a service calls :func:`wait_for_services` before it builds its
real clients. Services that start alongside the command (compose, Kubernetes) get
``startup_timeout_s`` to answer, with a log line per attempt; after that the command
stops with :class:`ServiceUnavailable`, whose message names the service, its address and
the setting that points at it. The CLI prints that line and exits non-zero: a newcomer
who forgot ``prm-pipeline up`` reads one sentence, not a traceback of half-started
clients.

The probes use the same client factories as everything else (``infra.kafka``'s
connection settings, ``infra.redis.make_redis``), so TLS and SASL settings are
exercised exactly as the real clients will use them, and every probe client is closed
whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

from infra.config import ConfigError, KafkaConfig, PipelineConfig, RedisConfig, redis_urls
from infra.errors import ServiceError
from infra.kafka import KafkaAccessRefused
from infra.redis import RedisAccessError
from infra.retry import backoff_delay

log = logging.getLogger(__name__)

Service = Literal["kafka", "redis"]
_REFUSALS = (KafkaAccessRefused, RedisAccessError)
_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 5.0


class ServiceUnavailable(ServiceError, RuntimeError):
    """A service did not answer within its ``startup_timeout_s``; ``str()`` is the one-line report."""

    def __init__(self, what: str, address: str, setting: str, cause: str, waited_s: float) -> None:
        self.what, self.address, self.setting, self.cause = what, address, setting, cause
        super().__init__(
            f"cannot reach {what} at {address} after {waited_s:.0f} s ({cause}); set {setting} to its "
            f"address, or start a local stack with `prm-pipeline up`"
        )


def redis_address(cfg: RedisConfig) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://host:6379/0`` (no credentials in messages);
    each of several cluster nodes (:func:`infra.config.redis_urls`) alike."""
    return ",".join(
        f"unix://{u.path}"
        if u.scheme == "unix"
        else f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}{u.path}"
        for u in redis_urls(cfg)
    )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, TimeoutError):
        return "no answer"
    return (
        text
        if isinstance(exc, ConnectionError) and text
        else (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    )


class _KafkaConnectLog(logging.Filter):
    """Holds back aiokafka's own "Unable connect to ..." error lines during a probe and keeps
    the last one: it names the OS error, which aiokafka's exception does not."""

    def __init__(self) -> None:
        super().__init__()
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.getMessage().startswith("Unable connect to"):
            self.last = record.getMessage()
            return False
        return True


class KafkaUnreachable(ServiceError, ConnectionError):
    """No bootstrap broker answered a metadata request."""


async def probe_kafka(cfg: KafkaConfig, timeout_s: float) -> None:
    """Fetch cluster metadata once from ``cfg.bootstrap``; raise if no broker answers."""
    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaConnectionError

    from infra.kafka import common_kwargs, diagnose_connection

    kwargs = common_kwargs(cfg)
    kwargs["request_timeout_ms"] = max(1, int(min(cfg.request_timeout_ms, timeout_s * 1000)))
    client = AIOKafkaClient(**kwargs)
    aiokafka_log, held = logging.getLogger("aiokafka"), _KafkaConnectLog()
    aiokafka_log.addFilter(held)
    try:
        async with asyncio.timeout(timeout_s):
            await client.bootstrap()
    except KafkaConnectionError:
        diagnosis = await diagnose_connection(cfg)
        if isinstance(diagnosis, KafkaAccessRefused):
            raise diagnosis from None  # untrusted certificate, wrong protocol, refused login: no retry
        raise KafkaUnreachable(held.last or "no bootstrap broker answered") from None
    finally:
        aiokafka_log.removeFilter(held)
        await client.close()


async def probe_redis(cfg: RedisConfig, timeout_s: float) -> None:
    """PING the configured Redis (standalone or cluster); raise if it does not answer."""
    from infra.redis import access_refusal, make_redis

    client = make_redis(cfg, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            await client.ping()
    except Exception as exc:
        refused = access_refusal(exc, cfg)
        if refused is not None:
            raise refused from None  # wrong password, ACL, untrusted certificate: no retry
        raise
    finally:
        await client.aclose()


async def wait_until_reachable(
    probe: Callable[[float], Awaitable[None]],
    *,
    what: str,
    address: str,
    setting: str,
    timeout_s: float,
) -> None:
    """Run ``probe`` until it succeeds, with growing pauses, for at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        attempt += 1
        remaining = deadline - time.monotonic()
        try:
            await probe(max(0.2, min(remaining, 10.0)))
        except (asyncio.CancelledError, *_REFUSALS):
            raise  # a refusal no retry fixes ends the wait at once, in one line
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "not reachable yet"
            cause = _describe(exc)
        else:
            if attempt > 1:
                log.warning("%s at %s is reachable (attempt %d)", what, address, attempt)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServiceUnavailable(what, address, setting, cause, timeout_s)
        pause = min(backoff_delay(attempt, base_s=_FIRST_DELAY_S, cap_s=_MAX_DELAY_S, jitter=False), remaining)
        log.warning(
            "%s at %s not reachable (attempt %d: %s); retrying in %.1f s, giving up in %.1f s",
            what,
            address,
            attempt,
            cause,
            pause,
            remaining,
        )
        await asyncio.sleep(pause)


async def wait_for_services(cfg: PipelineConfig, services: Iterable[Service]) -> None:
    """Wait for each named service in turn (Kafka first: nothing works without it)."""
    for service in sorted(set(services)):  # "kafka" < "redis"
        if service == "kafka":
            await wait_until_reachable(
                lambda t: probe_kafka(cfg.kafka, t),
                what="Kafka",
                address=cfg.kafka.bootstrap,
                setting="PRM_KAFKA_BOOTSTRAP (kafka.bootstrap)",
                timeout_s=cfg.kafka.startup_timeout_s,
            )
        elif service == "redis":
            await wait_until_reachable(
                lambda t: probe_redis(cfg.redis, t),
                what="Redis",
                address=redis_address(cfg.redis),
                setting="PRM_REDIS_URL (redis.url)",
                timeout_s=cfg.redis.startup_timeout_s,
            )
        else:
            raise ConfigError(f"unknown service {service!r}")
