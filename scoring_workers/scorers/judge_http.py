"""The judge's HTTP client: timeouts, retries and the shared limits around each request.

A :class:`JudgeClient` makes *logical requests* (:meth:`JudgeClient.post_json`). One
logical request is one or more HTTP *attempts*:

* **Timeouts.** Every attempt is bounded by ``timeout_s`` (a hard ``asyncio`` deadline
  around the whole HTTP exchange), and the logical request — waiting for a concurrency
  slot, rate pacing, every attempt and every backoff sleep — by ``total_timeout_s`` and
  by an optional caller ``deadline`` (a scorer's per-turn budget). Nothing ever waits
  longer than its deadline.
* **Retries** only where a retry can help and cannot double-apply anything: connect
  errors, HTTP 5xx and HTTP 429, at most ``max_retries`` times, with exponential
  backoff and jitter (``Retry-After`` is honoured up to ``backoff_max_s``). A 4xx other
  than 429 (a bug in the request), a read timeout and a broken response are not
  retried. A backoff that would cross the deadline is not slept: the last error is
  raised at once.
* **Shared limits** (:mod:`scoring_workers.scorers.judge_limits`): the concurrency cap,
  pacing and circuit breaker of the ``base_url``. Any HTTP answer below 500 (including
  4xx/429) proves the server is up and counts as a success for the breaker. A client
  built inside :func:`~scoring_workers.scorers.judge_limits.judge_quota` also takes its
  experiment's quota on each endpoint, acquired *before* the process-wide slot.
* **A pool** (several ``base_url`` s, replicas of one judge): every attempt is routed
  by :func:`~scoring_workers.scorers.judge_pool.choose_endpoint` — the session's
  rendezvous-preferred endpoint, the least-loaded one when that is overloaded, never
  one whose breaker is open — and each endpoint has its own shared limits. A failed
  attempt moves to another available endpoint at once (no backoff: that server is
  not the one struggling), within the same ``max_retries`` and deadline; there a read
  timeout or a dropped connection is worth a retry too, because another replica may
  answer. So a replica that fails or dies costs no vote while another one works.

Transport: :mod:`~scoring_workers.scorers.judge_transport` — HTTP/1.1 keep-alive
connections on asyncio protocols, one pool per client — with bodies encoded and decoded
by :mod:`msgspec`. It replaced aiohttp (≈ 3.5x the CPU of a bare asyncio-streams
exchange per call), which replaced httpx (≈ 12x); ``prm-pipeline bench judge`` measures
the client against that baseline. aiohttp remains for ``trust_env=True`` (proxies from
the environment). Only the transport module talks HTTP; ``scoring_workers.prm`` stays
light.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import msgspec

from scoring_workers.scorers.judge_errors import CircuitOpenError, JudgeRequestError, JudgeTimeoutError
from scoring_workers.scorers.judge_hosts import check_judge_url, endpoint_label
from scoring_workers.scorers.judge_limits import (
    CircuitBreaker,
    JudgeQuota,
    QuotaLimits,
    SharedLimits,
    acquire_limits,
    acquire_quota,
    active_quota,
    release_limits,
    release_quota,
)
from scoring_workers.scorers.judge_pool import SpillPolicy, choose_endpoint, rendezvous_order
from scoring_workers.scorers.judge_transport import (
    AiohttpTransport,
    HttpTransport,
    Transport,
    TransportError,
    check_headers,
)

__all__ = ["JudgeClient", "JudgeClientStats", "normalize_base_urls"]

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


class _Retry(Exception):
    """Internal: an attempt failed in a way that may be retried."""

    def __init__(self, error: JudgeRequestError, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.retry_after = retry_after


class _Failover(_Retry):
    """Internal: an attempt failed in a way worth retrying on *another* endpoint only
    (a read timeout, a dropped connection, an open breaker): the same server would
    likely fail again, a replica may not."""


@dataclass(slots=True)
class _Endpoint:
    base_url: str
    label: str  # host:port, for logs and metrics
    limits: SharedLimits
    quota: QuotaLimits | None = None  # the experiment's quota on this endpoint (judge_quota)

    def release(self) -> None:
        release_limits(self.limits)
        if self.quota is not None:
            release_quota(self.quota)


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
    failovers: int = 0
    """Retries sent to another endpoint of the pool than the attempt that failed."""


def _check_number(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # HTTP-date form: ignored, the exponential backoff applies
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _snippet(body: bytes, n: int) -> str:
    return repr(body[:n].decode("utf-8", "replace"))


class JudgeClient:
    """An async JSON-over-HTTP client for one judge server, with the hygiene described
    in the module docstring. It owns its connections (opened lazily inside the running
    event loop) and releases them and its share of the limits in
    :meth:`aclose`.

    Args:
        base_url: server root, e.g. ``http://judge:30000`` (a trailing ``/v1`` is
            stripped; paths are absolute: ``/v1/chat/completions``, ``/generate``),
            or a sequence of them: a pool of replicas (module docstring). Every URL
            must pass the enclosing ``worker.allowed_judge_hosts`` check
            (:func:`~scoring_workers.scorers.judge_hosts.check_judge_url`).
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
        headers: extra request headers; ``api_key_env`` (an environment variable),
            ``api_key_file`` (a file, e.g. a mounted Kubernetes Secret; surrounding
            whitespace stripped) or ``api_key`` add ``Authorization: Bearer ...``, the
            first one set winning. Keys never come from a trajectory.
        trust_env: let the client read proxy settings from the environment (off:
            judges are cluster-internal and a stray ``HTTP_PROXY`` breaks them).
        spill_in_flight, spill_ratio: when a pool's preferred endpoint is overloaded
            (:class:`~scoring_workers.scorers.judge_pool.SpillPolicy`).
        rng: random source for the jitter (tests pass a seeded one).
        clock: clock of a newly registered circuit breaker (tests pass a fake one).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
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
        api_key_file: str | None = None,
        trust_env: bool = False,
        spill_in_flight: int = 16,
        spill_ratio: float = 1.5,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        urls = normalize_base_urls(base_url)
        for url in urls:
            check_judge_url(url)
        self.base_urls: tuple[str, ...] = urls
        self.base_url = urls[0]
        """The (first) server root; a pool's others are in :attr:`base_urls`."""
        self.spill = SpillPolicy(spill_in_flight, spill_ratio)
        self.timeout_s = _check_number("timeout_s", timeout_s)
        self.total_timeout_s = _check_number("total_timeout_s", total_timeout_s)
        self.max_retries = _check_count("max_retries", max_retries, 0)
        self.backoff_base_s = _check_number("backoff_base_s", backoff_base_s, allow_zero=True)
        self.backoff_max_s = _check_number("backoff_max_s", backoff_max_s, allow_zero=True)
        self.retry_on_timeout = bool(retry_on_timeout)
        requested: dict[str, Any] = {}
        if max_concurrency is not None:
            requested["max_concurrency"] = _check_count("max_concurrency", max_concurrency, 1)
        if rps is not None:
            requested["rps"] = _check_number("rps", rps, allow_zero=True)
        if breaker_failure_threshold is not None:
            requested["breaker_failure_threshold"] = _check_count(
                "breaker_failure_threshold", breaker_failure_threshold, 1
            )
        if breaker_reset_s is not None:
            requested["breaker_reset_s"] = _check_number("breaker_reset_s", breaker_reset_s)
        hdrs = check_headers(headers or {})
        if api_key_file and not (api_key_env and os.environ.get(api_key_env)):
            try:
                api_key = Path(api_key_file).read_text().strip() or api_key
            except OSError as exc:
                raise ValueError(f"api_key_file {api_key_file!r} cannot be read: {exc.strerror}") from None
        if api_key_env:
            api_key = os.environ.get(api_key_env) or api_key
        if api_key:
            hdrs["Authorization"] = f"Bearer {api_key}"
        self._headers = hdrs
        self._trust_env = bool(trust_env)
        self._rng = rng or random.Random()
        self.stats = JudgeClientStats()
        self._transport: Transport | None = None
        self._closed = False
        self._turn = 0  # round-robin offset of a pool's ties
        quota = active_quota()
        self.quota: JudgeQuota | None = quota
        """The experiment quota taken at construction (:func:`~scoring_workers.scorers.
        judge_limits.judge_quota`), or None."""
        endpoints: list[_Endpoint] = []
        try:  # last: nothing else to undo
            for url in urls:
                endpoints.append(_Endpoint(url, endpoint_label(url), acquire_limits(url, requested, clock)))
                endpoints[-1].quota = acquire_quota(quota, url)
        except BaseException:
            for ep in endpoints:
                ep.release()
            raise
        self._endpoints: tuple[_Endpoint, ...] = tuple(endpoints)
        self.limits: SharedLimits = endpoints[0].limits
        """The (first) endpoint's shared limits; each pool endpoint has its own."""

    @property
    def breaker(self) -> CircuitBreaker:
        return self.limits.breaker

    @property
    def name(self) -> str:
        """The server root, or ``pool[host:port, ...]`` for a pool (for messages)."""
        if len(self._endpoints) == 1:
            return self.base_url
        return f"pool[{', '.join(ep.label for ep in self._endpoints)}]"

    @property
    def endpoint_limits(self) -> tuple[SharedLimits, ...]:
        """Each endpoint's shared limits, in :attr:`base_urls` order."""
        return tuple(ep.limits for ep in self._endpoints)

    @property
    def endpoint_quotas(self) -> tuple[QuotaLimits | None, ...]:
        """Each endpoint's experiment quota (None: no quota), in :attr:`base_urls` order."""
        return tuple(ep.quota for ep in self._endpoints)

    def _http(self) -> Transport:
        """The transport, opened on first use inside the running loop: this module's own
        HTTP/1.1 keep-alive connections (:class:`~scoring_workers.scorers.judge_transport.
        HttpTransport`), or aiohttp when ``trust_env`` asks for the environment's proxies.
        No connection limit of its own: the shared concurrency cap bounds attempts."""
        if self._closed:
            raise RuntimeError("JudgeClient is closed")
        transport = self._transport
        if transport is None:
            transport = self._transport = (
                AiohttpTransport(self._headers) if self._trust_env else HttpTransport(self._headers)
            )
        return transport

    async def aclose(self) -> None:
        """Close the connections and release this client's share of the limits (idempotent)."""
        if self._closed:
            return
        self._closed = True
        transport, self._transport = self._transport, None
        try:
            if transport is not None:
                await transport.aclose()
        finally:
            for ep in self._endpoints:
                ep.release()

    def discard(self) -> None:
        """Synchronous :meth:`aclose` for a client that never sent a request (e.g. its
        owner's constructor failed later): releases the shared limits."""
        if self._closed:
            return
        if self._transport is not None:
            raise RuntimeError("JudgeClient.discard() after use; await aclose() instead")
        self._closed = True
        for ep in self._endpoints:
            ep.release()

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

    async def post_json(
        self, path: str, payload: Any, *, deadline: float | None = None, affinity: str | None = None
    ) -> Any:
        """POST ``payload`` as JSON to ``base_url + path`` and return the decoded JSON.

        ``deadline`` is an absolute ``loop.time()`` bound on top of ``total_timeout_s``.
        ``affinity`` (a session id) picks a pool's preferred endpoint; calls with the
        same key go to the same replica while it is healthy and not overloaded.

        Raises:
            JudgeRequestError: (or :class:`JudgeTimeoutError`,
                :class:`CircuitOpenError`) when the request failed for good; with a
                pool, the error of the last endpoint tried.
        """
        loop = asyncio.get_running_loop()
        total_deadline = loop.time() + self.total_timeout_s
        if deadline is not None:
            total_deadline = min(total_deadline, deadline)
        body = _ENCODER.encode(payload)
        self.stats.requests += 1
        pool = len(self._endpoints) > 1
        order = rendezvous_order(affinity, self.base_urls) if pool and affinity else None
        failed: list[int] = []  # pool endpoints that failed this request, in order
        attempts = retries = 0
        try:
            while True:
                attempts += 1
                index = self._route(order, failed) if pool else 0
                try:
                    result = await self._attempt(loop, self._endpoints[index], path, body, total_deadline, attempts)
                except _Retry as retry:
                    error = retry.error
                    failed.append(index)
                    elsewhere = pool and self._alternative(failed)
                    # A pool endpoint whose breaker closed the door after routing (another
                    # call took its half-open probe) was sent nothing: moving on is free.
                    free = elsewhere and isinstance(error, CircuitOpenError)
                    if not free and retries >= self.max_retries:
                        raise error from None
                    if isinstance(retry, _Failover) and not elsewhere:
                        raise error from None  # only another endpoint could have helped
                    delay = 0.0 if elsewhere else self._backoff(retries + 1, retry.retry_after)
                    if loop.time() + delay >= total_deadline:
                        raise error from None  # the deadline leaves no room for another attempt
                    if not free:
                        retries += 1
                        self.stats.retries += 1
                    if elsewhere:
                        self.stats.failovers += 1
                    else:
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

    def _route(self, order: tuple[int, ...] | None, failed: list[int]) -> int:
        """The pool endpoint for the next attempt (:func:`choose_endpoint`)."""
        eps = self._endpoints
        self._turn += 1
        choice = choose_endpoint(
            [ep.limits.load for ep in eps], [ep.limits.breaker.admits() for ep in eps], order=order,
            policy=self.spill, caps=[ep.limits.settings.max_concurrency for ep in eps],
            latencies=[ep.limits.latency_ewma_s for ep in eps], avoid=failed, start=self._turn,
        )
        if choice is None:
            raise CircuitOpenError(
                f"{self.name}: every endpoint's circuit breaker is open, failing fast", kind="circuit_open"
            )
        index, route = choice
        eps[index].limits.routed[route] += 1
        return index

    def _alternative(self, failed: list[int]) -> bool:
        """Whether an endpoint that has not failed this request admits a call."""
        return any(i not in failed and ep.limits.breaker.admits() for i, ep in enumerate(self._endpoints))

    async def _attempt(
        self, loop: asyncio.AbstractEventLoop, endpoint: _Endpoint, path: str, body: bytes, total_deadline: float,
        attempt: int,
    ) -> Any:
        url = endpoint.base_url + path
        if loop.time() >= total_deadline:
            raise JudgeTimeoutError(f"POST {url}: total timeout before attempt {attempt}", kind="timeout")
        if endpoint.quota is not None:
            return await self._under_quota(loop, endpoint.quota, endpoint.limits, url, body, total_deadline)
        return await self._loaded(loop, endpoint.limits, url, body, total_deadline)

    async def _loaded(
        self, loop: asyncio.AbstractEventLoop, limits: SharedLimits, url: str, body: bytes, total_deadline: float,
    ) -> Any:
        semaphore, pacer = limits.for_loop(loop)
        limits.load += 1
        try:
            return await self._admitted(loop, limits, semaphore, pacer, url, body, total_deadline)
        finally:
            limits.load -= 1

    async def _under_quota(
        self, loop: asyncio.AbstractEventLoop, quota: QuotaLimits, limits: SharedLimits, url: str, body: bytes,
        total_deadline: float,
    ) -> Any:
        """The experiment's quota on this endpoint first, then the process-wide limits:
        a call waiting for its quota holds no process-wide slot (and adds no load)."""
        semaphore, pacer = quota.for_loop(loop)
        waiting_since: float | None = None
        acquired = False
        try:
            if semaphore is not None:
                if semaphore.locked():
                    waiting_since = loop.time()
                    try:
                        async with asyncio.timeout_at(total_deadline):
                            await semaphore.acquire()
                    except TimeoutError:
                        raise JudgeTimeoutError(
                            f"POST {url}: experiment {quota.scope!r} has no free judge slot (quota "
                            f"max_in_flight={quota.quota.max_in_flight} per endpoint) before the total timeout",
                            kind="timeout",
                        ) from None
                else:
                    await semaphore.acquire()
                acquired = True
            if pacer is not None:
                if waiting_since is None and pacer.next_at > loop.time():
                    waiting_since = loop.time()
                if not await pacer.wait(loop, total_deadline):
                    raise JudgeTimeoutError(
                        f"POST {url}: experiment {quota.scope!r}'s quota ({quota.quota.rps:g} req/s per endpoint) "
                        "leaves no slot before the total timeout",
                        kind="timeout",
                    )
        except BaseException:
            if acquired:
                semaphore.release()  # type: ignore[union-attr]
            raise
        finally:
            if waiting_since is not None:
                quota.waited += 1
                quota.wait_s += loop.time() - waiting_since
        quota.admitted += 1
        quota.in_flight += 1
        if quota.in_flight > quota.peak_in_flight:
            quota.peak_in_flight = quota.in_flight
        try:
            return await self._loaded(loop, limits, url, body, total_deadline)
        finally:
            quota.in_flight -= 1
            if acquired:
                semaphore.release()  # type: ignore[union-attr]

    async def _admitted(
        self, loop: asyncio.AbstractEventLoop, limits: SharedLimits, semaphore: asyncio.Semaphore,
        pacer: Any, url: str, body: bytes, total_deadline: float,
    ) -> Any:
        if semaphore.locked():
            try:
                async with asyncio.timeout_at(total_deadline):
                    await semaphore.acquire()
            except TimeoutError:
                raise JudgeTimeoutError(
                    f"POST {url}: no free judge slot (max_concurrency={limits.settings.max_concurrency}) "
                    "before the total timeout",
                    kind="timeout",
                ) from None
        else:
            await semaphore.acquire()  # a free slot: no timeout context to set up
        try:
            if pacer is not None and not await pacer.wait(loop, total_deadline):
                raise JudgeTimeoutError(
                    f"POST {url}: rate limit ({limits.settings.rps} req/s) leaves no slot before the total timeout",
                    kind="timeout",
                )
            breaker = limits.breaker
            ticket = breaker.acquire()
            if ticket is None:
                raise _Failover(CircuitOpenError(
                    f"POST {url}: circuit breaker open after {breaker.failure_threshold} consecutive failed "
                    f"attempts, failing fast (a probe goes through {breaker.reset_timeout_s:g}s after it opened); last error: "
                    f"{breaker.last_error or 'unknown'}", kind="circuit_open"))
            verdict: bool | None = None
            failure: str | None = None
            started = loop.time()
            limits.in_flight += 1
            limits.max_in_flight = max(limits.max_in_flight, limits.in_flight)
            self.stats.attempts += 1
            try:
                attempt_deadline = min(loop.time() + self.timeout_s, total_deadline)
                budget = attempt_deadline - loop.time()
                transport = self._http()
                try:
                    status, raw, retry_after = await transport.post(url, body, attempt_deadline)
                except TimeoutError:
                    verdict = False
                    error = JudgeTimeoutError(f"POST {url}: no answer within {budget:.3g}s", kind="timeout")
                    failure = str(error)
                    if self.retry_on_timeout:
                        raise _Retry(error) from None
                    raise _Failover(error) from None
                except TransportError as exc:
                    verdict = False
                    if exc.connect:
                        failure = f"POST {url}: cannot connect: {exc}"
                        raise _Retry(JudgeRequestError(failure, kind="connect")) from None
                    failure = f"POST {url}: {exc}"
                    raise _Failover(JudgeRequestError(failure, kind="transport")) from None
                verdict = status < 500
                if not verdict:
                    failure = f"POST {url}: HTTP {status}: {_snippet(raw, 200)}"
                if status >= 500 or status == 429:
                    raise _Retry(
                        JudgeRequestError(
                            f"POST {url}: HTTP {status}: {_snippet(raw, 200)}", kind="http_status", status=status
                        ),
                        _parse_retry_after(retry_after),
                    )
                if status >= 400:
                    raise JudgeRequestError(
                        f"POST {url}: HTTP {status} (not retried): {_snippet(raw, 500)}",
                        kind="http_status",
                        status=status,
                    )
                try:
                    return _DECODER.decode(raw)
                except msgspec.DecodeError:
                    raise JudgeRequestError(
                        f"POST {url}: response is not JSON: {_snippet(raw, 200)}", kind="bad_response"
                    ) from None
            finally:
                limits.in_flight -= 1
                breaker.record(ticket, verdict, failure)
                took = loop.time() - started
                limits.observe(took, failed=verdict is False)
                if verdict:
                    limits.answered(took)
        finally:
            semaphore.release()


def normalize_base_urls(base_url: str | Sequence[str]) -> tuple[str, ...]:
    """One server root or a pool's list as normalized roots (trailing ``/`` and ``/v1``
    stripped), checked: http(s) URLs, at least one, none twice."""
    if isinstance(base_url, str):
        raw: list[Any] = [base_url]
    elif isinstance(base_url, Sequence) and base_url:
        raw = list(base_url)
    else:
        raise ValueError(f"base_url must be an http(s) URL or a non-empty list of them, got {base_url!r}")
    urls: list[str] = []
    for item in raw:
        if not isinstance(item, str) or not item.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {item!r}")
        url = item.rstrip("/").removesuffix("/v1")
        if url in urls:
            raise ValueError(f"judge pool lists {endpoint_label(url)} twice; list each replica once")
        urls.append(url)
    return tuple(urls)
