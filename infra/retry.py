"""One retry policy: bounded exponential backoff and which errors are worth waiting for.

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

from infra.config import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Told of each retry before its pause: the error, the attempt that failed (1-based), the pause in seconds.
OnRetry = Callable[[BaseException, int, float], None]


def backoff_delay(attempt: int, *, base_s: float = 0.2, cap_s: float = 10.0, jitter: bool = True,
                  rng: random.Random | None = None) -> float:
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

    async def run(self, op: Callable[[], Awaitable[T]], *, what: str = "operation",
                  on_retry: OnRetry | None = None) -> T:
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
                    log.warning("transient %s during %s (attempt %d: %s), retrying in %.2fs",
                                type(exc).__name__, what, attempt, exc, delay)
                await asyncio.sleep(delay)
