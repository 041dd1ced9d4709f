"""HTTP hygiene for LLM-judge (and teacher) calls: timeouts, retries, limits, breaker.

A :class:`JudgeClient` makes *logical requests* (:meth:`JudgeClient.post_json`). One
logical request is one or more HTTP *attempts*:

* **Timeouts.** Every attempt is bounded by ``timeout_s`` (a hard ``asyncio`` deadline
  around the whole HTTP exchange, not only httpx's per-phase timeouts), and the
  logical request — waiting for a concurrency slot, rate pacing, every attempt and
  every backoff sleep — by ``total_timeout_s`` and by an optional caller ``deadline``
  (a scorer's per-turn budget). Nothing ever waits longer than its deadline.
* **Retries** only where a retry can help and cannot double-apply anything: connect
  errors (``httpx.ConnectError``/``ConnectTimeout``), HTTP 5xx and HTTP 429, at most
  ``max_retries`` times, with exponential backoff and jitter (``Retry-After`` is
  honoured up to ``backoff_max_s``). A 4xx other than 429 (a bug in the request), a
  read timeout and a broken response are not retried. A backoff that would cross the
  deadline is not slept: the last error is raised at once.
* **Shared limits.** A concurrency cap, an optional requests-per-second pace and a
  circuit breaker are shared by *every* client with the same ``base_url`` in the
  process (a module-level registry, reference-counted by live clients), so all scorer
  instances of a worker together respect what the judge server can take.
* **Circuit breaker** (closed / open / half-open): ``breaker_failure_threshold``
  consecutive failed attempts (transport error, timeout or 5xx) open it; while open,
  requests fail immediately with :class:`CircuitOpenError` instead of piling onto a
  dead judge; after ``breaker_reset_s`` one probe is let through (half-open) — its
  success closes the breaker, its failure re-opens it. Any HTTP answer below 500
  (including 4xx/429) proves the server is up and counts as a success.

Only this module and the scorer modules import :mod:`httpx`; ``scoring_workers.prm``
stays light.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx

__all__ = [
    "JUDGE_APIS",
    "CircuitBreaker",
    "CircuitOpenError",
    "JudgeClient",
    "JudgeClientStats",
    "JudgeEndpoint",
    "JudgeRequestError",
    "JudgeTimeoutError",
    "SharedLimits",
    "openai_chat",
    "registered_limits",
    "resolve_callable",
    "sglang_generate_text",
    "sglang_input_logprobs",
]


# --------------------------------------------------------------------------- errors
class JudgeRequestError(Exception):
    """A logical judge request failed.

    ``kind`` is one of ``connect``, ``timeout``, ``http_status``, ``transport``,
    ``circuit_open``, ``bad_response``; ``status`` is the HTTP status when there was
    one; ``attempts`` the number of HTTP attempts made.
    """

    def __init__(self, message: str, *, kind: str, status: int | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.attempts = attempts

    def __reduce__(self):
        return (_rebuild_error, (type(self), str(self), self.kind, self.status, self.attempts))


def _rebuild_error(cls, message, kind, status, attempts):
    return cls(message, kind=kind, status=status, attempts=attempts)


class JudgeTimeoutError(JudgeRequestError):
    """An attempt or the whole logical request ran out of time (deliberately *not* a
    :class:`TimeoutError`, which the worker reads as its own scoring timeout)."""


class CircuitOpenError(JudgeRequestError):
    """The judge's circuit breaker is open: failing fast without a request."""


class _Retry(Exception):
    """Internal: an attempt failed in a way that may be retried."""

    def __init__(self, error: JudgeRequestError, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


# --------------------------------------------------------------------------- breaker
class CircuitBreaker:
    """Closed / open / half-open circuit breaker with an injectable clock.

    Use :meth:`acquire` before an attempt (``None`` = rejected, fail fast) and
    :meth:`record` after it with ``True`` (the server answered), ``False`` (it did
    not, or answered 5xx) or ``None`` (no verdict, e.g. cancelled). Thread-safe.
    """

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __init__(
        self,
        failure_threshold: int = 5,
        reset_timeout_s: float = 10.0,
        *,
        half_open_max_calls: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be an integer >= 1, got {failure_threshold!r}")
        if not _positive(reset_timeout_s):
            raise ValueError(f"reset_timeout_s must be a finite number > 0, got {reset_timeout_s!r}")
        if isinstance(half_open_max_calls, bool) or not isinstance(half_open_max_calls, int) or half_open_max_calls < 1:
            raise ValueError(f"half_open_max_calls must be an integer >= 1, got {half_open_max_calls!r}")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = float(reset_timeout_s)
        self.half_open_max_calls = half_open_max_calls
        self._clock = clock
        self._lock = threading.Lock()
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probes = 0
        self.opened_count = 0
        """How many times the breaker opened (a monotonically increasing counter)."""
        self.rejected_count = 0
        """How many attempts were refused while open / half-open with no probe slot."""

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open`` (an open breaker whose reset timeout
        has elapsed reports ``half_open``: the next :meth:`acquire` will probe)."""
        with self._lock:
            if self._state == self.OPEN and self._clock() - self._opened_at >= self.reset_timeout_s:
                return self.HALF_OPEN
            return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def acquire(self) -> _Ticket | None:
        """Permission for one attempt, or ``None`` to fail fast."""
        with self._lock:
            if self._state == self.OPEN:
                if self._clock() - self._opened_at < self.reset_timeout_s:
                    self.rejected_count += 1
                    return None
                self._state = self.HALF_OPEN
                self._probes = 0
            if self._state == self.HALF_OPEN:
                if self._probes >= self.half_open_max_calls:
                    self.rejected_count += 1
                    return None
                self._probes += 1
                return _Ticket(probe=True)
            return _Ticket(probe=False)

    def record(self, ticket: _Ticket, success: bool | None) -> None:
        """Report how the attempt admitted by ``ticket`` ended."""
        with self._lock:
            if ticket.done:
                return
            ticket.done = True
            if ticket.probe:
                if self._state != self.HALF_OPEN:
                    return  # stale probe: another probe already decided
                self._probes = max(0, self._probes - 1)
                if success is True:
                    self._state = self.CLOSED
                    self._failures = 0
                elif success is False:
                    self._open()
                return
            if self._state != self.CLOSED:
                return  # admitted before the breaker opened: its verdict is stale
            if success is True:
                self._failures = 0
            elif success is False:
                self._failures += 1
                if self._failures >= self.failure_threshold:
                    self._open()

    def _open(self) -> None:
        self._state = self.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        self._probes = 0
        self.opened_count += 1

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self.state!r}, failures={self._failures}, opened={self.opened_count})"


class _Ticket:
    __slots__ = ("done", "probe")

    def __init__(self, probe: bool) -> None:
        self.probe = probe
        self.done = False


# --------------------------------------------------------------------------- shared limits
def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


class _Pacer:
    """Requests-per-second pacing: slots ``1/rps`` apart, reserved in arrival order."""

    def __init__(self, rps: float) -> None:
        self.interval = 1.0 / rps
        self.next_at = 0.0

    async def wait(self, loop: asyncio.AbstractEventLoop, deadline: float) -> bool:
        now = loop.time()
        at = max(now, self.next_at)
        if at > deadline:
            return False  # the slot would come too late: do not reserve it
        self.next_at = at + self.interval
        if at > now:
            await asyncio.sleep(at - now)
        return True


@dataclass(frozen=True, slots=True)
class _LimitSettings:
    max_concurrency: int
    rps: float
    breaker_failure_threshold: int
    breaker_reset_s: float


_DEFAULT_LIMITS = _LimitSettings(max_concurrency=32, rps=0.0, breaker_failure_threshold=5, breaker_reset_s=10.0)


class SharedLimits:
    """Process-wide limits of one judge ``base_url`` (see :func:`registered_limits`).

    Holds the circuit breaker and, per event loop, the concurrency semaphore and the
    rate pacer (asyncio primitives are bound to one loop). ``in_flight`` /
    ``max_in_flight`` count attempts currently on the wire (client side).
    """

    def __init__(self, key: str, settings: _LimitSettings, clock: Callable[[], float]) -> None:
        self.key = key
        self.settings = settings
        self.breaker = CircuitBreaker(
            settings.breaker_failure_threshold, settings.breaker_reset_s, clock=clock
        )
        self.refs = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[asyncio.Semaphore, _Pacer | None]]
        self._per_loop = weakref.WeakKeyDictionary()

    def for_loop(self, loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Semaphore, _Pacer | None]:
        entry = self._per_loop.get(loop)
        if entry is None:
            pacer = _Pacer(self.settings.rps) if self.settings.rps > 0 else None
            entry = (asyncio.Semaphore(self.settings.max_concurrency), pacer)
            self._per_loop[loop] = entry
        return entry


_REGISTRY: dict[str, SharedLimits] = {}
_REGISTRY_LOCK = threading.Lock()


def _registry_key(base_url: str) -> str:
    return base_url.rstrip("/")


def registered_limits(base_url: str) -> SharedLimits | None:
    """The live :class:`SharedLimits` of ``base_url`` (``None`` if no client uses it)."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(_registry_key(base_url))


def _acquire_limits(base_url: str, requested: dict[str, Any], clock: Callable[[], float]) -> SharedLimits:
    key = _registry_key(base_url)
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            values = {name: getattr(_DEFAULT_LIMITS, name) for name in _LimitSettings.__slots__}
            values.update({k: v for k, v in requested.items() if v is not None})
            shared = SharedLimits(key, _LimitSettings(**values), clock)
            _REGISTRY[key] = shared
        else:
            clash = {
                name: (value, getattr(shared.settings, name))
                for name, value in requested.items()
                if value is not None and value != getattr(shared.settings, name)
            }
            if clash:
                detail = ", ".join(f"{n}={mine!r} (registered: {theirs!r})" for n, (mine, theirs) in clash.items())
                raise ValueError(
                    f"judge limits for {key} are shared by every client in the process and are already "
                    f"registered with different values: {detail}. Configure every scorer that calls "
                    "this server with the same limits, or leave them unset to inherit."
                )
        shared.refs += 1
        return shared


def _release_limits(shared: SharedLimits) -> None:
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs <= 0 and _REGISTRY.get(shared.key) is shared:
            del _REGISTRY[shared.key]


# --------------------------------------------------------------------------- client
class _Pool:
    __slots__ = ("http", "in_flight")

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.in_flight = 0


@dataclass(slots=True)
class JudgeClientStats:
    """Counters of one client (logical requests and HTTP attempts)."""

    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    attempts: int = 0
    retries: int = 0
    timeouts: int = 0
    circuit_rejections: int = 0


def _check_number(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # HTTP-date form: ignored, the exponential backoff applies
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class JudgeClient:
    """An async JSON-over-HTTP client for one judge server, with the hygiene described
    in the module docstring. It owns its ``httpx.AsyncClient`` (created lazily inside
    the running event loop, sharded into ``pool_size``-connection pools) and releases
    them and its share of the limits in :meth:`aclose`.

    Args:
        base_url: server root, e.g. ``http://judge:30000`` (a trailing ``/v1`` is
            stripped; paths are absolute: ``/v1/chat/completions``, ``/generate``).
        timeout_s: bound of one HTTP attempt.
        total_timeout_s: bound of one logical request, retries included.
        max_retries: retries after the first attempt (connect errors, 5xx, 429).
        backoff_base_s, backoff_max_s: backoff before retry ``k`` is drawn uniformly
            from ``[d/2, d]`` with ``d = min(backoff_max_s, backoff_base_s * 2**(k-1))``.
        retry_on_timeout: also retry attempts that hit ``timeout_s`` (off: a judge
            that is too slow rarely gets faster by being asked again).
        max_concurrency, rps, breaker_failure_threshold, breaker_reset_s: the shared
            per-``base_url`` limits; ``None`` inherits what is registered (defaults
            32, unlimited, 5, 10 s). ``rps=0`` means no pacing.
        headers: extra request headers; ``api_key`` / ``api_key_env`` add
            ``Authorization: Bearer ...`` (prefer the environment variable).
        trust_env: let httpx read proxy settings from the environment (off: judges
            are cluster-internal and a stray ``HTTP_PROXY`` breaks them).
        pool_size: connections per internal httpx client; more concurrent attempts
            open more clients (see :meth:`_pool` for why connections are sharded).
        rng: random source for the jitter (tests pass a seeded one).
        clock: clock of a newly registered circuit breaker (tests pass a fake one).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        total_timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 5.0,
        retry_on_timeout: bool = False,
        max_concurrency: int | None = None,
        rps: float | None = None,
        breaker_failure_threshold: int | None = None,
        breaker_reset_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        trust_env: bool = False,
        pool_size: int = 8,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        root = base_url.rstrip("/")
        root = root.removesuffix("/v1")
        self.base_url = root
        self.timeout_s = _check_number("timeout_s", timeout_s)
        self.total_timeout_s = _check_number("total_timeout_s", total_timeout_s)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        self.max_retries = max_retries
        self.backoff_base_s = _check_number("backoff_base_s", backoff_base_s, allow_zero=True)
        self.backoff_max_s = _check_number("backoff_max_s", backoff_max_s, allow_zero=True)
        self.retry_on_timeout = bool(retry_on_timeout)
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"pool_size must be an integer >= 1, got {pool_size!r}")
        self.pool_size = pool_size
        requested: dict[str, Any] = {}
        if max_concurrency is not None:
            if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
                raise ValueError(f"max_concurrency must be an integer >= 1, got {max_concurrency!r}")
            requested["max_concurrency"] = max_concurrency
        if rps is not None:
            requested["rps"] = _check_number("rps", rps, allow_zero=True)
        if breaker_failure_threshold is not None:
            if (
                isinstance(breaker_failure_threshold, bool)
                or not isinstance(breaker_failure_threshold, int)
                or breaker_failure_threshold < 1
            ):
                raise ValueError(
                    f"breaker_failure_threshold must be an integer >= 1, got {breaker_failure_threshold!r}"
                )
            requested["breaker_failure_threshold"] = breaker_failure_threshold
        if breaker_reset_s is not None:
            requested["breaker_reset_s"] = _check_number("breaker_reset_s", breaker_reset_s)
        hdrs = {str(k): str(v) for k, v in (headers or {}).items()}
        if api_key_env:
            api_key = os.environ.get(api_key_env) or api_key
        if api_key:
            hdrs["Authorization"] = f"Bearer {api_key}"
        self._headers = hdrs
        self._trust_env = bool(trust_env)
        self._rng = rng or random.Random()
        self.stats = JudgeClientStats()
        self._pools: list[_Pool] = []
        self._verify: Any = None
        self._closed = False
        self.limits = _acquire_limits(self.base_url, requested, clock)  # last: nothing to undo on errors above

    @property
    def breaker(self) -> CircuitBreaker:
        return self.limits.breaker

    def _pool(self) -> _Pool:
        """The least-loaded connection pool, opening a new one while all are full.

        httpcore's pool does O(pool size) work (idle checks, a readability poll per
        connection) for every request, so one pool of 64 connections serves far fewer
        requests per second than eight pools of 8 (measured in ``tests/perf/
        bench_judge.py``). Connections are therefore spread over ``pool_size``-sized
        httpx clients, opened lazily.
        """
        if self._closed:
            raise RuntimeError("JudgeClient is closed")
        best = min(self._pools, key=lambda p: p.in_flight, default=None)
        if best is None or best.in_flight >= self.pool_size:
            if self._verify is None:
                # Loading CA certificates costs ~40 ms of CPU: once per client, not per pool,
                # and not at all for plain-HTTP judges.
                self._verify = httpx.create_ssl_context() if self.base_url.startswith("https://") else False
            best = _Pool(httpx.AsyncClient(
                verify=self._verify,
                headers=self._headers,
                trust_env=self._trust_env,
                limits=httpx.Limits(max_connections=self.pool_size, max_keepalive_connections=self.pool_size),
                timeout=httpx.Timeout(self.timeout_s),
            ))
            self._pools.append(best)
        return best

    async def aclose(self) -> None:
        """Close the HTTP clients and release this client's share of the limits (idempotent)."""
        if self._closed:
            return
        self._closed = True
        pools, self._pools = self._pools, []
        try:
            for pool in pools:
                await pool.http.aclose()
        finally:
            _release_limits(self.limits)

    def discard(self) -> None:
        """Synchronous :meth:`aclose` for a client that never sent a request (e.g. its
        owner's constructor failed later): releases the shared limits."""
        if self._closed:
            return
        if self._pools:
            raise RuntimeError("JudgeClient.discard() after use; await aclose() instead")
        self._closed = True
        _release_limits(self.limits)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _backoff(self, retry: int, retry_after: float | None) -> float:
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2 ** (retry - 1)))
        delay = self._rng.uniform(ceiling / 2, ceiling) if ceiling > 0 else 0.0
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.backoff_max_s))
        return delay

    async def post_json(self, path: str, payload: Any, *, deadline: float | None = None) -> Any:
        """POST ``payload`` as JSON to ``base_url + path`` and return the decoded JSON.

        ``deadline`` is an absolute ``loop.time()`` bound on top of ``total_timeout_s``.

        Raises:
            JudgeRequestError: (or :class:`JudgeTimeoutError`,
                :class:`CircuitOpenError`) when the request failed for good.
        """
        loop = asyncio.get_running_loop()
        total_deadline = loop.time() + self.total_timeout_s
        if deadline is not None:
            total_deadline = min(total_deadline, deadline)
        url = self.base_url + path
        self.stats.requests += 1
        attempts = 0
        try:
            while True:
                attempts += 1
                try:
                    result = await self._attempt(loop, url, payload, total_deadline, attempts)
                except _Retry as retry:
                    error = retry.error
                    if attempts > self.max_retries:
                        raise error from None
                    delay = self._backoff(attempts, retry.retry_after)
                    if loop.time() + delay >= total_deadline:
                        raise error from None  # the deadline leaves no room for another attempt
                    self.stats.retries += 1
                    await asyncio.sleep(delay)
                    continue
                self.stats.succeeded += 1
                return result
        except JudgeRequestError as error:
            error.attempts = attempts
            self.stats.failed += 1
            if isinstance(error, JudgeTimeoutError):
                self.stats.timeouts += 1
            elif isinstance(error, CircuitOpenError):
                self.stats.circuit_rejections += 1
            raise

    async def _attempt(
        self, loop: asyncio.AbstractEventLoop, url: str, payload: Any, total_deadline: float, attempt: int
    ) -> Any:
        limits = self.limits
        semaphore, pacer = limits.for_loop(loop)
        if loop.time() >= total_deadline:
            raise JudgeTimeoutError(f"POST {url}: total timeout before attempt {attempt}", kind="timeout")
        try:
            async with asyncio.timeout_at(total_deadline):
                await semaphore.acquire()
        except TimeoutError:
            raise JudgeTimeoutError(
                f"POST {url}: no free judge slot (max_concurrency={limits.settings.max_concurrency}) "
                "before the total timeout",
                kind="timeout",
            ) from None
        try:
            if pacer is not None and not await pacer.wait(loop, total_deadline):
                raise JudgeTimeoutError(
                    f"POST {url}: rate limit ({limits.settings.rps} req/s) leaves no slot before the total timeout",
                    kind="timeout",
                )
            ticket = limits.breaker.acquire()
            if ticket is None:
                raise CircuitOpenError(f"POST {url}: circuit breaker open, failing fast", kind="circuit_open")
            verdict: bool | None = None
            pool: _Pool | None = None
            limits.in_flight += 1
            limits.max_in_flight = max(limits.max_in_flight, limits.in_flight)
            self.stats.attempts += 1
            try:
                attempt_deadline = min(loop.time() + self.timeout_s, total_deadline)
                budget = max(attempt_deadline - loop.time(), 1e-3)
                pool = self._pool()
                pool.in_flight += 1
                try:
                    async with asyncio.timeout_at(attempt_deadline):
                        response = await pool.http.post(url, json=payload, timeout=httpx.Timeout(budget))
                except TimeoutError:
                    verdict = False
                    error = JudgeTimeoutError(f"POST {url}: no answer within {budget:.3g}s", kind="timeout")
                    if self.retry_on_timeout:
                        raise _Retry(error) from None
                    raise error from None
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    verdict = False
                    raise _Retry(
                        JudgeRequestError(f"POST {url}: cannot connect: {exc!r}", kind="connect")
                    ) from None
                except httpx.TimeoutException as exc:
                    verdict = False
                    error = JudgeTimeoutError(f"POST {url}: {type(exc).__name__}: {exc}", kind="timeout")
                    if self.retry_on_timeout:
                        raise _Retry(error) from None
                    raise error from None
                except httpx.TransportError as exc:
                    verdict = False
                    raise JudgeRequestError(f"POST {url}: {type(exc).__name__}: {exc}", kind="transport") from None
                status = response.status_code
                verdict = status < 500
                if status >= 500 or status == 429:
                    raise _Retry(
                        JudgeRequestError(
                            f"POST {url}: HTTP {status}: {response.text[:200]!r}", kind="http_status", status=status
                        ),
                        _parse_retry_after(response.headers.get("retry-after")),
                    )
                if status >= 400:
                    raise JudgeRequestError(
                        f"POST {url}: HTTP {status} (not retried): {response.text[:500]!r}",
                        kind="http_status",
                        status=status,
                    )
                try:
                    return response.json()
                except ValueError:
                    raise JudgeRequestError(
                        f"POST {url}: response is not JSON: {response.text[:200]!r}", kind="bad_response"
                    ) from None
            finally:
                if pool is not None:
                    pool.in_flight -= 1
                limits.in_flight -= 1
                limits.breaker.record(ticket, verdict)
        finally:
            semaphore.release()


# --------------------------------------------------------------------------- APIs
async def openai_chat(
    client: JudgeClient,
    messages: Sequence[Mapping[str, Any]],
    *,
    model: str,
    temperature: float,
    max_tokens: int,
    deadline: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """One OpenAI-compatible ``/v1/chat/completions`` call; returns the message content."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "temperature": temperature,
        "max_tokens": max_tokens,
        "stream": False,
    }
    if extra:
        payload.update(extra)
    data = await client.post_json("/v1/chat/completions", payload, deadline=deadline)
    try:
        content = data["choices"][0]["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise JudgeRequestError(
            f"{client.base_url}/v1/chat/completions: unexpected response shape: {str(data)[:200]!r}",
            kind="bad_response",
        ) from None
    return content if isinstance(content, str) else ""


async def sglang_generate_text(
    client: JudgeClient,
    text: str,
    *,
    temperature: float,
    max_new_tokens: int,
    deadline: float | None = None,
) -> str:
    """One SGLang ``/generate`` call on a rendered prompt (OpenClaw-RL's sampling params)."""
    payload = {
        "text": text,
        "sampling_params": {
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": max_new_tokens,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        },
        "return_logprob": False,
    }
    data = await client.post_json("/generate", payload, deadline=deadline)
    raw = data.get("text") if isinstance(data, Mapping) else data
    if isinstance(raw, list):
        raw = raw[0] if raw else ""
    if isinstance(raw, Mapping):
        raw = raw.get("text", "")
    if not isinstance(raw, str):
        raise JudgeRequestError(
            f"{client.base_url}/generate: unexpected response shape: {str(data)[:200]!r}", kind="bad_response"
        )
    return raw


async def sglang_input_logprobs(
    client: JudgeClient,
    input_ids: Sequence[int],
    *,
    logprob_start_len: int,
    deadline: float | None = None,
) -> list[float | None]:
    """Teacher-force ``input_ids`` through SGLang ``/generate`` (``max_new_tokens=0``) and
    return the log-prob column of ``meta_info.input_token_logprobs`` (one entry per
    position from ``logprob_start_len`` on; a position without context is ``None``)."""
    payload = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": int(logprob_start_len),
    }
    data = await client.post_json("/generate", payload, deadline=deadline)
    if isinstance(data, list):
        data = data[0] if data else {}
    try:
        rows = data["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        raise JudgeRequestError(
            f"{client.base_url}/generate: no meta_info.input_token_logprobs in the answer", kind="bad_response"
        ) from None
    out: list[float | None] = []
    for row in rows:
        value = row[0] if isinstance(row, (list, tuple)) else (row.get("logprob") if isinstance(row, Mapping) else row)
        out.append(None if value is None else float(value))
    return out


# --------------------------------------------------------------------------- endpoint
def resolve_callable(spec: Any, what: str) -> Callable[..., Any]:
    """A callable given directly or by import path ``"pkg.module:attr"`` / ``"pkg.module.attr"``."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what} must be a callable or an import path 'module:attr', got {spec!r}")
    import importlib

    path = spec.strip()
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must have the form 'module:attr' or 'module.attr'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r} cannot be imported: {exc}") from exc
    if not callable(target):
        raise TypeError(f"{what} {spec!r} is not callable")
    return target


JUDGE_APIS = ("openai", "sglang")


class JudgeEndpoint:
    """One judge model behind a :class:`JudgeClient`: turns chat messages into the
    judge's answer text through ``api="openai"`` (``/v1/chat/completions``; the server
    applies its chat template) or ``api="sglang"`` (``/generate`` on a prompt rendered
    by ``chat_template``, default ChatML as used by Qwen judges)."""

    def __init__(
        self,
        client: JudgeClient,
        *,
        api: str = "openai",
        model: str = "default",
        temperature: float = 0.6,
        max_tokens: int = 4096,
        chat_template: Any = None,
    ) -> None:
        if api not in JUDGE_APIS:
            raise ValueError(f"api must be one of {JUDGE_APIS}, got {api!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        self.client = client
        self.api = api
        self.model = model
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        if chat_template is None:
            from scoring_workers.scorers.judge import render_chatml

            chat_template = render_chatml
        self.chat_template = resolve_callable(chat_template, "chat_template")

    async def complete(self, messages: Sequence[Mapping[str, Any]], *, deadline: float | None = None) -> str:
        if self.api == "openai":
            return await openai_chat(
                self.client, messages, model=self.model, temperature=self.temperature,
                max_tokens=self.max_tokens, deadline=deadline,
            )
        text = self.chat_template(messages)
        if not isinstance(text, str):
            raise TypeError(f"chat_template must return a string, got {type(text).__name__}")
        return await sglang_generate_text(
            self.client, text, temperature=self.temperature, max_new_tokens=self.max_tokens, deadline=deadline
        )
