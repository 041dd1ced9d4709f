"""The judge's HTTP client: timeouts, retries and the shared limits around each request.

A :class:`JudgeClient` makes *logical requests* (:meth:`JudgeClient.post_json`). One
logical request is one or more HTTP *attempts*:

* **Timeouts.** Every attempt is bounded by ``timeout_s`` (a hard ``asyncio`` deadline
  around the whole HTTP exchange), and the logical request — waiting for a concurrency
  slot, rate pacing, every attempt and every backoff sleep — by ``total_timeout_s`` and
  by an optional caller ``deadline`` (a scorer's per-turn budget). Nothing ever waits
  longer than its deadline.
* **Retries** only where a retry can help and cannot double-apply anything: connect
  errors, HTTP 5xx and HTTP 429, at most ``max_retries`` times, with the project's
  exponential backoff and jitter (:class:`infra.retry.RetryPolicy`: ``backoff_base_s``
  first, doubling up to ``backoff_max_s``; ``Retry-After`` is a floor, up to ``backoff_max_s``). A 4xx other
  than 429 (a bug in the request), a read timeout and a broken response are not
  retried. A backoff that would cross the deadline is not slept: the last error is
  raised at once.
* **Shared limits** (:mod:`scoring_workers.judge.limits`): the concurrency cap,
  pacing and circuit breaker of the ``base_url``. Any HTTP answer below 500 (including
  4xx/429) proves the server is up and counts as a success for the breaker. A client
  built inside :func:`~scoring_workers.judge.limits.judge_quota` (a registry
  experiment's: a tenant) sets none of them: its limit settings become its own
  narrowing limits and its own breaker (:class:`~scoring_workers.judge.limits.
  OwnLimits`), entered before its experiment's quota, which is entered before the
  process-wide slot.
* **URLs in messages** are rendered by :func:`~scoring_workers.judge.hosts.redact_url`
  (``scheme://host:port``): a URL's user info, path or query may be a credential, and
  errors reach verdict reasons and logs.
* **A pool** (several ``base_url`` s, replicas of one judge): every attempt is routed
  by :func:`~scoring_workers.judge.pool.choose_endpoint` — the session's
  rendezvous-preferred endpoint, the least-loaded one when that is overloaded, never
  one whose breaker is open — and each endpoint has its own shared limits. A failed
  attempt moves to another available endpoint at once (no backoff: that server is
  not the one struggling), within the same ``max_retries`` and deadline; there a read
  timeout or a dropped connection is worth a retry too, because another replica may
  answer. So a replica that fails or dies costs no vote while another one works.

Transport: :mod:`~scoring_workers.judge.transport` — HTTP/1.1 keep-alive
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import msgspec

from infra.config import ConfigError
from infra.retry import RetryPolicy
from scoring_workers.judge.errors import CircuitOpenError, JudgeRequestError, JudgeTimeoutError
from scoring_workers.judge.hosts import check_judge_url, endpoint_label, redact_url
from scoring_workers.judge.limits import (
    CircuitBreaker,
    JudgeQuota,
    OwnLimits,
    QuotaLimits,
    SharedLimits,
    acquire_limits,
    acquire_quota,
    active_quota,
    release_limits,
    release_quota,
)
from scoring_workers.judge.pool import choose_endpoint, rendezvous_order
from scoring_workers.judge.settings import ClientSettings, ConnectionSettings, LimitSettings
from scoring_workers.judge.transport import (
    AiohttpTransport,
    HttpTransport,
    Transport,
    TransportError,
    check_headers,
)

__all__ = ["JudgeClient", "JudgeClientStats", "normalize_base_urls"]

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


_DEFAULTS = ClientSettings()
_INHERIT = LimitSettings()  # every field unset: the endpoint's registered (operator's) limits


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
    own: OwnLimits | None = None  # a tenant client's own limits and breaker (judge_quota)
    origin: str = ""  # scheme://host:port: how messages name the endpoint (redact_url)

    def __post_init__(self) -> None:
        self.origin = redact_url(self.base_url)

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker this client's calls consult and count in: its own (a tenant's) or the endpoint's."""
        return self.limits.breaker if self.own is None else self.own.breaker

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
    """An async JSON-over-HTTP client for one judge server (or a pool of replicas), with
    the hygiene described in the module docstring. It owns its connections (opened
    lazily inside the running event loop) and releases them and its share of the limits
    in :meth:`aclose`.

    Args:
        base_url: server root, e.g. ``http://judge:30000`` (a trailing ``/v1`` is
            stripped; paths are absolute: ``/v1/chat/completions``, ``/generate``),
            or a sequence of them: a pool of replicas (module docstring). Every URL
            must pass the enclosing ``worker.allowed_judge_hosts`` check
            (:func:`~scoring_workers.judge.hosts.check_judge_url`).
        settings: timeouts and retries, the endpoints' shared limits, headers and
            credentials, a pool's spill policy
            (:class:`~scoring_workers.judge.settings.ClientSettings`). Keys never come
            from a trajectory.
        rng: random source for the jitter (tests pass a deterministic one).
        clock: clock of a newly registered circuit breaker (tests pass a fake one).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        settings: ClientSettings = _DEFAULTS,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(settings, ClientSettings):
            raise TypeError(f"settings must be a ClientSettings, got {type(settings).__name__}")
        urls = normalize_base_urls(base_url)
        for url in urls:
            check_judge_url(url)
        self.base_urls: tuple[str, ...] = urls
        self.base_url = urls[0]
        """The (first) server root; a pool's others are in :attr:`base_urls`."""
        self.settings = settings
        self._request = settings.request
        request = settings.request
        self._retry = RetryPolicy(
            retryable=lambda exc: isinstance(exc, _Retry),
            base_s=request.backoff_base_s,
            cap_s=request.backoff_max_s,
            max_attempts=request.max_retries + 1,
        )
        self.spill = settings.spill
        self._headers = _headers(settings.connection)
        self._rng = rng or random.Random()
        self.stats = JudgeClientStats()
        self._transport: Transport | None = None
        self._closed = False
        self._turn = 0  # round-robin offset of a pool's ties
        quota = active_quota()
        self.quota: JudgeQuota | None = quota
        """The experiment quota taken at construction (:func:`~scoring_workers.judge.
        limits.judge_quota`), or None."""
        # a tenant (inside judge_quota) sets no process-wide limit: it joins what the operator set
        shared = settings.limits if quota is None else _INHERIT
        endpoints: list[_Endpoint] = []
        try:  # last: nothing else to undo
            for url in urls:
                endpoints.append(_Endpoint(url, endpoint_label(url), acquire_limits(url, shared, clock)))
                endpoints[-1].quota = acquire_quota(quota, url)
                if quota is not None:
                    endpoints[-1].own = OwnLimits(settings.limits, endpoints[-1].limits, clock)
        except BaseException:
            for ep in endpoints:
                ep.release()
            raise
        self._endpoints: tuple[_Endpoint, ...] = tuple(endpoints)
        self.limits: SharedLimits = endpoints[0].limits
        """The (first) endpoint's shared limits; each pool endpoint has its own."""

    @property
    def breaker(self) -> CircuitBreaker:
        """The (first) endpoint's breaker this client's calls consult: a tenant's own, else the endpoint's."""
        return self._endpoints[0].breaker

    @property
    def name(self) -> str:
        """``scheme://host:port`` of the server, or ``pool[host:port, ...]`` for a pool
        (for messages: never a URL's user info, path or query)."""
        if len(self._endpoints) == 1:
            return self._endpoints[0].origin
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
        """The transport, opened on first use inside the running loop: the judge's own
        HTTP/1.1 keep-alive connections (:class:`~scoring_workers.judge.transport.
        HttpTransport`), or aiohttp when ``trust_env`` asks for the environment's proxies.
        No connection limit of its own: the shared concurrency cap bounds attempts."""
        if self._closed:
            raise RuntimeError("JudgeClient is closed")
        transport = self._transport
        if transport is None:
            transport = self._transport = (
                AiohttpTransport(self._headers) if self.settings.connection.trust_env else HttpTransport(self._headers)
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

    async def post_json(
        self, path: str, payload: Any, *, deadline: float | None = None, affinity: str | None = None
    ) -> Any:
        """POST ``payload`` as JSON to ``base_url + path`` and return the decoded JSON.

        ``deadline`` is an absolute ``loop.time()`` bound on top of the settings'
        ``total_timeout_s``.
        ``affinity`` (a session id) picks a pool's preferred endpoint; calls with the
        same key go to the same replica while it is healthy and not overloaded.

        Raises:
            JudgeRequestError: (or :class:`JudgeTimeoutError`,
                :class:`CircuitOpenError`) when the request failed for good; with a
                pool, the error of the last endpoint tried.
        """
        loop = asyncio.get_running_loop()
        total_deadline = loop.time() + self._request.total_timeout_s
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
                    if not free and self._retry.gives_up(retries + 1):
                        raise error from None
                    if isinstance(retry, _Failover) and not elsewhere:
                        raise error from None  # only another endpoint could have helped
                    delay = (
                        0.0
                        if elsewhere
                        else self._retry.delay(retries + 1, retry_after=retry.retry_after, rng=self._rng)
                    )
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
            [ep.limits.load for ep in eps],
            [ep.breaker.admits() for ep in eps],
            order=order,
            policy=self.spill,
            caps=[ep.limits.settings.max_concurrency for ep in eps],
            latencies=[ep.limits.latency_ewma_s for ep in eps],
            avoid=failed,
            start=self._turn,
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
        return any(i not in failed and ep.breaker.admits() for i, ep in enumerate(self._endpoints))

    async def _attempt(
        self,
        loop: asyncio.AbstractEventLoop,
        endpoint: _Endpoint,
        path: str,
        body: bytes,
        total_deadline: float,
        attempt: int,
    ) -> Any:
        """One attempt on ``endpoint``: a tenant's own limits first, then the experiment's
        quota, then the endpoint's process-wide limits — a call waiting for its own
        limits or its quota holds no process-wide slot (and adds no load) — all entered
        the one way (:meth:`~scoring_workers.judge.limits.SharedLimits.enter`)."""
        url = endpoint.base_url + path
        shown = endpoint.origin  # what messages say: never the URL's user info, path or query
        if loop.time() >= total_deadline:
            raise JudgeTimeoutError(f"POST {shown}: total timeout before attempt {attempt}", kind="timeout")
        own = endpoint.own
        held_own = None if own is None else await own.enter(loop, total_deadline, shown)
        try:
            quota = endpoint.quota
            if quota is None:
                return await self._loaded(loop, endpoint, url, body, total_deadline)
            held = await quota.enter(loop, total_deadline, shown)
            quota.admitted += 1
            quota.in_flight += 1
            if quota.in_flight > quota.peak_in_flight:
                quota.peak_in_flight = quota.in_flight
            try:
                return await self._loaded(loop, endpoint, url, body, total_deadline)
            finally:
                quota.in_flight -= 1
                if held is not None:
                    held.release()
        finally:
            if held_own is not None:
                held_own.release()

    async def _loaded(
        self,
        loop: asyncio.AbstractEventLoop,
        endpoint: _Endpoint,
        url: str,
        body: bytes,
        total_deadline: float,
    ) -> Any:
        limits = endpoint.limits
        limits.load += 1
        try:
            held = await limits.enter(loop, total_deadline, endpoint.origin)
            try:
                return await self._exchange(loop, endpoint, url, body, total_deadline)
            finally:
                if held is not None:
                    held.release()
        finally:
            limits.load -= 1

    async def _exchange(
        self,
        loop: asyncio.AbstractEventLoop,
        endpoint: _Endpoint,
        url: str,
        body: bytes,
        total_deadline: float,
    ) -> Any:
        """The HTTP exchange of an admitted attempt, under this client's circuit breaker
        (:attr:`_Endpoint.breaker`)."""
        limits, breaker = endpoint.limits, endpoint.breaker
        shown = endpoint.origin
        ticket = breaker.acquire()
        if ticket is None:
            raise _Failover(
                CircuitOpenError(
                    f"POST {shown}: circuit breaker open after {breaker.failure_threshold} consecutive failed "
                    f"attempts, failing fast (a probe goes through {breaker.reset_timeout_s:g}s after it opened); "
                    f"last error: {breaker.last_error or 'unknown'}",
                    kind="circuit_open",
                )
            )
        verdict: bool | None = None
        failure: str | None = None
        started = loop.time()
        limits.in_flight += 1
        limits.max_in_flight = max(limits.max_in_flight, limits.in_flight)
        self.stats.attempts += 1
        try:
            attempt_deadline = min(loop.time() + self._request.timeout_s, total_deadline)
            budget = attempt_deadline - loop.time()
            transport = self._http()
            try:
                status, raw, retry_after = await transport.post(url, body, attempt_deadline)
            except TimeoutError:
                verdict = False
                error = JudgeTimeoutError(f"POST {shown}: no answer within {budget:.3g}s", kind="timeout")
                failure = str(error)
                if self._request.retry_on_timeout:
                    raise _Retry(error) from None
                raise _Failover(error) from None
            except TransportError as exc:
                verdict = False
                if exc.connect:
                    failure = f"POST {shown}: cannot connect: {exc}"
                    raise _Retry(JudgeRequestError(failure, kind="connect")) from None
                failure = f"POST {shown}: {exc}"
                raise _Failover(JudgeRequestError(failure, kind="transport")) from None
            verdict = status < 500
            if not verdict:
                failure = f"POST {shown}: HTTP {status}: {_snippet(raw, 200)}"
            if status >= 500 or status == 429:
                raise _Retry(
                    JudgeRequestError(
                        f"POST {shown}: HTTP {status}: {_snippet(raw, 200)}", kind="http_status", status=status
                    ),
                    _parse_retry_after(retry_after),
                )
            if status >= 400:
                raise JudgeRequestError(
                    f"POST {shown}: HTTP {status} (not retried): {_snippet(raw, 500)}",
                    kind="http_status",
                    status=status,
                )
            try:
                return _DECODER.decode(raw)
            except msgspec.DecodeError:
                raise JudgeRequestError(
                    f"POST {shown}: response is not JSON: {_snippet(raw, 200)}", kind="bad_response"
                ) from None
        finally:
            limits.in_flight -= 1
            breaker.record(ticket, verdict, failure)
            took = loop.time() - started
            limits.observe(took, failed=verdict is False)
            if verdict:
                limits.answered(took)


def _headers(connection: ConnectionSettings) -> dict[str, str]:
    """The request headers: the configured ones (checked) and the bearer key, if any."""
    headers = check_headers(connection.headers)
    api_key, env, path = connection.api_key, connection.api_key_env, connection.api_key_file
    if path and not (env and os.environ.get(env)):
        try:
            api_key = Path(path).read_text().strip() or api_key
        except OSError as exc:
            raise ConfigError(f"api_key_file {path!r} cannot be read: {exc.strerror}") from None
    if env:
        api_key = os.environ.get(env) or api_key
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def normalize_base_urls(base_url: str | Sequence[str]) -> tuple[str, ...]:
    """One server root or a pool's list as normalized roots (trailing ``/`` and ``/v1``
    stripped), checked: http(s) URLs, at least one, none twice."""
    if isinstance(base_url, str):
        raw: list[Any] = [base_url]
    elif isinstance(base_url, Sequence) and base_url:
        raw = list(base_url)
    else:
        raise ConfigError(f"base_url must be an http(s) URL or a non-empty list of them, got {base_url!r}")
    urls: list[str] = []
    for item in raw:
        if not isinstance(item, str) or not item.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must be an http(s) URL, got {item!r}")
        url = item.rstrip("/").removesuffix("/v1")
        if url in urls:
            raise ConfigError(f"judge pool lists {endpoint_label(url)} twice; list each replica once")
        urls.append(url)
    return tuple(urls)
