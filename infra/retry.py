"""One retry policy: bounded exponential backoff, and the one place that says which errors are worth waiting for.

Classification (:func:`is_transient`, :func:`is_retriable`, :func:`is_permanent`) lives
here, beside the policy that uses it: a Redis outage (unavailable, loading its AOF after a
restart, full, a cluster slot moving), a Kafka error aiokafka flags retriable or a broker
outage, and a network error below the clients are transient; a Kafka error no retry can
fix is permanent. Every retry loop in the project asks these, never its own list.

A :class:`RetryPolicy` says how long to wait before each retry (:meth:`RetryPolicy.delay`)
and which errors a retry can fix (``retryable``). One convention for every backoff in the
project: ``base_s`` is the pause before the first retry, doubling after each failure up to
``cap_s`` (``base * 2**(attempt-1)``, the judge client's and most HTTP clients'), so a
caller states the first pause it wants, never a value adjusted for the formula. :meth:`RetryPolicy.run` is the common
loop: it awaits an operation, retries a retryable error after the delay (telling
``on_retry`` first, which logs and counts it), and re-raises any other error at once, or
a retryable one once ``max_attempts`` attempts have failed.

Loops with more to do than that (the worker's per-record loop, which dead-letters after
a number of permanent failures, and the start-up wait, which has a deadline) keep their
own structure and take only :meth:`RetryPolicy.delay` from here; so does the judge client,
whose retries may move to another replica of a pool, with a server's ``Retry-After`` as a
floor under the pause.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiokafka import errors as kerr
from redis.exceptions import BusyLoadingError, OutOfMemoryError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from infra.config import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Redis errors that are an outage, worth waiting for: unavailable, loading its AOF after a
# restart, full (noeviction), or a cluster slot moving. An outage must delay work, never
# dead-letter valid records.
REDIS_OUTAGES: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    OutOfMemoryError,
    TryAgainError,
)
# Errors no retry can fix: the record, the topic or the credentials must change first.
# aiokafka flags all of them non-retriable; they are listed so that the intent is explicit
# (and survives a change of flags upstream).
PERMANENT_KAFKA_ERRORS: tuple[type[kerr.KafkaError], ...] = (
    kerr.MessageSizeTooLargeError,
    kerr.RecordTooLargeError,
    kerr.RecordListTooLargeError,
    kerr.InvalidTopicError,
    kerr.TopicAuthorizationFailedError,
    kerr.GroupAuthorizationFailedError,
    kerr.ClusterAuthorizationFailedError,
    kerr.TransactionalIdAuthorizationFailed,
    kerr.AuthenticationFailedError,
    kerr.SaslAuthenticationFailed,
    kerr.UnsupportedSaslMechanismError,
    kerr.UnsupportedVersionError,
    kerr.UnsupportedForMessageFormatError,
    kerr.IncompatibleBrokerVersion,
    kerr.UnsupportedCodecError,
    kerr.PolicyViolationError,
    kerr.CorruptRecordException,
)
# Outages that aiokafka flags non-retriable although waiting fixes them: a request the
# broker did not answer within ``request_timeout_ms`` (a restarting broker), or no
# broker reachable at all.
OUTAGE_KAFKA_ERRORS: tuple[type[kerr.KafkaError], ...] = (kerr.KafkaTimeoutError, kerr.KafkaUnavailableError)


def is_retriable(exc: BaseException) -> bool:
    """A Kafka error worth retrying with backoff: aiokafka's ``retriable`` flag, or an outage.

    Network errors below the client (``ConnectionError``/``OSError``) count too. Anything
    else Kafka raises is permanent (:func:`is_permanent`).
    """
    if isinstance(exc, PERMANENT_KAFKA_ERRORS):
        return False
    if isinstance(exc, kerr.KafkaError):
        return bool(exc.retriable) or isinstance(exc, OUTAGE_KAFKA_ERRORS)
    return isinstance(exc, (ConnectionError, OSError))


def is_permanent(exc: BaseException) -> bool:
    """A Kafka error that retrying cannot fix (the explicit list, or not flagged retriable)."""
    return isinstance(exc, kerr.KafkaError) and not is_retriable(exc)


def is_transient(exc: BaseException) -> bool:
    """An outage worth waiting for: Redis unavailable/loading/full, or a retriable Kafka or network error."""
    return isinstance(exc, REDIS_OUTAGES) or is_retriable(exc)


# Told of each retry before its pause: the error, the attempt that failed (1-based), the pause in seconds.
OnRetry = Callable[[BaseException, int, float], None]


def backoff_delay(
    attempt: int, *, base_s: float = 0.2, cap_s: float = 10.0, jitter: bool = True, rng: random.Random | None = None
) -> float:
    """Bounded exponential backoff before retry ``attempt`` (1-based): ``d = min(cap, base * 2**(attempt-1))``
    (``base_s`` is the first pause), drawn from ``[d/2, d]`` with ``jitter`` so that workers hit by one outage
    do not retry in step (``rng``: the random source, for tests; the module's by default)."""
    delay = min(cap_s, base_s * 2 ** min(max(attempt - 1, 0), 30))
    return delay * (rng or random).uniform(0.5, 1.0) if jitter else delay


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How to retry: ``retryable(exc)`` says whether waiting can fix an error; the pause
    before retry ``n`` is :func:`backoff_delay` of ``n`` (``base_s``, ``cap_s``, ``jitter``);
    ``max_attempts`` bounds the attempts (``None``: retry for as long as the error lasts).
    ``base_s = 0`` retries at once."""

    retryable: Callable[[BaseException], bool]
    base_s: float = 0.2
    cap_s: float = 10.0
    jitter: bool = True
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.base_s <= self.cap_s:
            raise ConfigError(f"a retry policy needs 0 <= base_s <= cap_s, not {self.base_s} and {self.cap_s}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1 (or None), not {self.max_attempts}")

    def delay(self, attempt: int, *, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        """The pause after failed attempt ``attempt`` (1-based), before the next one; at least
        ``retry_after`` (a server's ``Retry-After``), itself capped at ``cap_s``."""
        delay = backoff_delay(attempt, base_s=self.base_s, cap_s=self.cap_s, jitter=self.jitter, rng=rng)
        return delay if retry_after is None else max(delay, min(retry_after, self.cap_s))

    def gives_up(self, attempt: int) -> bool:
        """Whether no attempt follows failed attempt ``attempt`` (``max_attempts`` reached)."""
        return self.max_attempts is not None and attempt >= self.max_attempts

    async def run(
        self, op: Callable[[], Awaitable[T]], *, what: str = "operation", on_retry: OnRetry | None = None
    ) -> T:
        """``await op()`` until it succeeds. A retryable error is retried after :meth:`delay`
        (``on_retry`` is told of it first; without one it is logged as a warning naming
        ``what`` and the error); any other error, or the last allowed attempt's, is raised at once.
        Cancellation is never caught."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await op()
            except Exception as exc:
                if not self.retryable(exc) or self.gives_up(attempt):
                    raise
                delay = self.delay(attempt)
                if on_retry is not None:
                    on_retry(exc, attempt, delay)
                else:
                    log.warning(
                        "transient %s during %s (attempt %d: %s), retrying in %.2fs",
                        type(exc).__name__,
                        what,
                        attempt,
                        exc,
                        delay,
                    )
                await asyncio.sleep(delay)
