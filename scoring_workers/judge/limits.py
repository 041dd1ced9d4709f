"""Process-wide limits of one judge server: concurrency cap, request pacing, circuit breaker.

Every :class:`~scoring_workers.judge.client.JudgeClient` with the same
``base_url`` shares one :class:`SharedLimits` (a module-level registry, reference-counted
by live clients), so all scorer instances of a worker together respect what the judge
server can take.

* **Concurrency cap** — an ``asyncio.Semaphore`` per event loop (asyncio primitives
  are bound to one loop).
* **Pacing** (:class:`_Pacer`) — optional requests per second, slots ``1/rps`` apart.
* **Circuit breaker** (:class:`CircuitBreaker`, closed / open / half-open):
  ``failure_threshold`` consecutive failed attempts open it; while open, requests fail
  immediately instead of piling onto a dead judge; after ``reset_timeout_s`` one probe
  is let through (half-open) — its success closes the breaker, its failure re-opens it.

**Quotas per experiment** (:class:`~scoring_workers.judge.settings.JudgeQuota`,
:func:`judge_quota`): one worker
process may score several experiments against the same judge. An experiment's quota
caps *its* calls in flight and per second on each endpoint; every client built inside
``judge_quota(q)`` shares one :class:`QuotaLimits` per ``(q.scope, endpoint)`` (a second
registry, reference-counted like the shared limits). A call takes its quota slot first
and the endpoint's process-wide slot second, so an experiment over its quota waits
without holding a process-wide slot that another experiment could use; the process-wide
limits still bound every experiment together.

**Tenants** (registry experiments). A process-wide limit set by one experiment would be
a lever on every other one (a tiny ``rps`` starving them all, a tiny ``timeout_s``
opening everyone's breaker). So the process-wide limits and breaker of an endpoint are
the *operator's*: set only by clients built outside a tenant scope — the scorers of the
worker's own config file — or :data:`DEFAULT_LIMITS`. A client built inside
:func:`judge_quota` (every registry experiment's, :mod:`scoring_workers.fleet`) joins
the endpoint's limits without setting them, and what its own settings ask —
``max_concurrency``, ``rps``, ``breaker_*``, whether from an operator profile or the
record — becomes its :class:`OwnLimits`: a limiter that only narrows, and a circuit
breaker of its own that its failures (its timeouts included) open and that only its
calls consult. Nothing an experiment sets slows down, rejects or trips another's call.

Every kind of limit is entered the same one way (:meth:`_Limiter.enter`: a slot, then
pacing, both by the request's deadline); they differ only in their bounds and in what a
refusal says. A call enters its own limits, its experiment's quota, then the endpoint's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import msgspec

from infra.config import ConfigError
from scoring_workers.judge.errors import JudgeTimeoutError
from scoring_workers.judge.settings import JudgeQuota, LimitSettings

__all__ = [
    "DEFAULT_LIMITS",
    "EndpointLimits",
    "LATENCY_BUCKETS_S",
    "CircuitBreaker",
    "JudgeQuota",
    "OwnLimits",
    "QuotaLimits",
    "SharedLimits",
    "acquire_limits",
    "acquire_quota",
    "active_quota",
    "all_limits",
    "all_quotas",
    "judge_quota",
    "registered_limits",
    "release_limits",
    "release_quota",
]


class CircuitBreaker:
    """Closed / open / half-open circuit breaker with an injectable clock.

    Use :meth:`acquire` before an attempt (``None`` = rejected, fail fast) and
    :meth:`record` after it with ``True`` (the server answered), ``False`` (it did
    not, or answered 5xx; pass what went wrong as ``error``) or ``None`` (no verdict,
    e.g. cancelled). :attr:`last_error` keeps the last failure's description, so a
    request refused while the breaker is open can say *why* it opened. Thread-safe.
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
            raise ConfigError(f"failure_threshold must be an integer >= 1, got {failure_threshold!r}")
        if not _positive(reset_timeout_s):
            raise ConfigError(f"reset_timeout_s must be a finite number > 0, got {reset_timeout_s!r}")
        if isinstance(half_open_max_calls, bool) or not isinstance(half_open_max_calls, int) or half_open_max_calls < 1:
            raise ConfigError(f"half_open_max_calls must be an integer >= 1, got {half_open_max_calls!r}")
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
        self.last_error: str | None = None
        """The last failed attempt's description (e.g. ``connection refused``), or None."""

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

    def admits(self) -> bool:
        """Whether :meth:`acquire` would grant an attempt now, without taking a probe slot.

        What a judge pool routes by: an open breaker (reset timeout not yet elapsed) or a
        half-open one whose probe is already out is skipped."""
        with self._lock:
            if self._state == self.OPEN:
                return self._clock() - self._opened_at >= self.reset_timeout_s
            if self._state == self.HALF_OPEN:
                return self._probes < self.half_open_max_calls
            return True

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

    def record(self, ticket: _Ticket, success: bool | None, error: str | None = None) -> None:
        """Report how the attempt admitted by ``ticket`` ended (``error``: what went wrong)."""
        with self._lock:
            if ticket.done:
                return
            ticket.done = True
            if success is False and error:
                self.last_error = error[:500]
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


# --------------------------------------------------------------------------- the one way in
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


class _Gate:
    """A concurrency cap (``None``: none) and a pacer (``None``: none) on one event loop."""

    __slots__ = ("pacer", "semaphore")

    def __init__(self, cap: int | None, rps: float | None) -> None:
        self.semaphore = None if cap is None else asyncio.Semaphore(cap)
        self.pacer = None if not rps else _Pacer(rps)


class _Limiter:
    """What :class:`SharedLimits` and :class:`QuotaLimits` share: a :class:`_Gate` per event
    loop (asyncio primitives are bound to one loop) and the one way through it,
    :meth:`enter`. ``waited`` / ``wait_s``: how many entries had to wait (for a slot or
    for pacing) and the seconds they waited in total."""

    def __init__(self, cap: int | None, rps: float | None) -> None:
        self._cap, self._rps = cap, rps
        self.waited = 0
        self.wait_s = 0.0
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Gate] = weakref.WeakKeyDictionary()

    def _refusal(self, what: str) -> str:  # pragma: no cover - overridden
        """What ran out (``slot`` or ``rate``), for the timeout's message."""
        raise NotImplementedError

    def gate(self, loop: asyncio.AbstractEventLoop) -> _Gate:
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = _Gate(self._cap, self._rps)
        return gate

    async def enter(self, loop: asyncio.AbstractEventLoop, deadline: float, origin: str) -> asyncio.Semaphore | None:
        """Wait for a slot, then for pacing, both by ``deadline``; returns the semaphore
        whose slot is now held (release it when the attempt is over), or ``None``.
        ``origin``: the endpoint as a refusal names it (``scheme://host:port``, :func:`~scoring_workers.
        judge.hosts.redact_url`).

        Raises:
            JudgeTimeoutError: ``deadline`` came first (nothing is held then).
        """
        gate = self.gate(loop)
        semaphore, pacer = gate.semaphore, gate.pacer
        since: float | None = None
        try:
            if semaphore is not None:
                if semaphore.locked():
                    since = loop.time()
                    try:
                        async with asyncio.timeout_at(deadline):
                            await semaphore.acquire()
                    except TimeoutError:
                        raise JudgeTimeoutError(
                            f"POST {origin}: {self._refusal('slot')} before the total timeout", kind="timeout"
                        ) from None
                else:
                    await semaphore.acquire()  # a free slot: no timeout context to set up
            if pacer is not None:
                try:
                    if since is None and pacer.next_at > loop.time():
                        since = loop.time()
                    if not await pacer.wait(loop, deadline):
                        raise JudgeTimeoutError(
                            f"POST {origin}: {self._refusal('rate')} before the total timeout", kind="timeout"
                        )
                except BaseException:
                    if semaphore is not None:
                        semaphore.release()
                    raise
        finally:
            if since is not None:
                self.waited += 1
                self.wait_s += loop.time() - since
        return semaphore


# --------------------------------------------------------------------------- shared limits
class EndpointLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The limits in force on one judge endpoint: a :class:`~scoring_workers.judge.settings.
    LimitSettings` with every field set (what its first client asked, the rest inherited
    from :data:`DEFAULT_LIMITS`); ``rps=0`` means no pacing."""

    max_concurrency: int
    rps: float
    breaker_failure_threshold: int
    breaker_reset_s: float


DEFAULT_LIMITS = EndpointLimits(max_concurrency=32, rps=0.0, breaker_failure_threshold=5, breaker_reset_s=10.0)
"""What a judge endpoint's limits are when no client sets them."""


class SharedLimits(_Limiter):
    """Process-wide limits of one judge ``base_url`` (see :func:`registered_limits`).

    Holds the circuit breaker and, per event loop, the concurrency semaphore and the
    rate pacer. ``in_flight`` / ``max_in_flight`` count attempts currently on the wire
    (client side); ``load`` counts attempts routed here and not finished (waiting for a
    slot or pacing, or on the wire) — what a judge pool compares to find the
    least-loaded endpoint — and ``routed`` how pool requests were routed here
    (``affinity``, ``detour``, ``spill``, ``failover``, ``balanced``;
    :mod:`scoring_workers.judge.pool`).
    """

    def __init__(self, key: str, settings: EndpointLimits, clock: Callable[[], float]) -> None:
        super().__init__(settings.max_concurrency, settings.rps)
        self.key = key
        self.settings = settings
        self.breaker = CircuitBreaker(
            settings.breaker_failure_threshold,
            settings.breaker_reset_s,
            clock=clock,
        )
        self.refs = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.load = 0
        self.routed: Counter[str] = Counter()
        self.latency_ewma_s: float | None = None  # answered attempts; what a pool weighs the load by
        # attempts on the wire, for the workers' metrics (scoring_workers/judge_metrics.py)
        self.attempts = 0
        self.failed_attempts = 0  # those the breaker counts as failures (timeouts, connect errors, 5xx)
        self.latency_buckets = [0] * len(LATENCY_BUCKETS_S)  # cumulative counts per upper bound
        self.latency_sum_s = 0.0

    def _refusal(self, what: str) -> str:
        if what == "slot":
            return f"no free judge slot (max_concurrency={self.settings.max_concurrency})"
        return f"rate limit ({self.settings.rps} req/s) leaves no slot"

    def observe(self, seconds: float, *, failed: bool) -> None:
        """One finished attempt: its duration and whether the breaker counted it as a failure."""
        self.attempts += 1
        self.failed_attempts += failed
        self.latency_sum_s += seconds
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if seconds <= bound:
                self.latency_buckets[i] += 1

    def answered(self, seconds: float) -> None:
        """An attempt the server answered (any status below 500): update the latency EWMA."""
        ewma = self.latency_ewma_s
        self.latency_ewma_s = seconds if ewma is None else ewma + _EWMA_ALPHA * (seconds - ewma)


_EWMA_ALPHA = 0.2  # weight of the newest answer: about the last ten answers count


class OwnLimits(_Limiter):
    """A tenant client's own limits on one endpoint (module docstring, "Tenants").

    ``requested``: the client's limit settings; its ``max_concurrency`` and ``rps`` bound
    only this client's calls (entered before the quota and the endpoint's limits, so they
    can only narrow), and its circuit breaker — ``breaker_*`` as requested, else the
    endpoint's operator settings — counts only this client's attempts.
    """

    def __init__(self, requested: LimitSettings, endpoint: SharedLimits, clock: Callable[[], float]) -> None:
        super().__init__(requested.max_concurrency, requested.rps or None)
        self.requested = requested
        operator = endpoint.settings
        self.breaker = CircuitBreaker(
            requested.breaker_failure_threshold or operator.breaker_failure_threshold,
            requested.breaker_reset_s or operator.breaker_reset_s,
            clock=clock,
        )

    def _refusal(self, what: str) -> str:
        if what == "slot":
            return f"no free slot of the scorer's own (max_concurrency={self.requested.max_concurrency})"
        return f"the scorer's own rate limit ({self.requested.rps:g} req/s) leaves no slot"


LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_REGISTRY: dict[str, SharedLimits] = {}
_REGISTRY_LOCK = threading.Lock()


def _registry_key(base_url: str) -> str:
    return base_url.rstrip("/")


def registered_limits(base_url: str) -> SharedLimits | None:
    """The live :class:`SharedLimits` of ``base_url`` (``None`` if no client uses it)."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(_registry_key(base_url))


def all_limits() -> list[SharedLimits]:
    """Every live :class:`SharedLimits` of this process (one per judge server in use)."""
    with _REGISTRY_LOCK:
        return list(_REGISTRY.values())


def acquire_limits(base_url: str, requested: LimitSettings, clock: Callable[[], float]) -> SharedLimits:
    """Take a reference to ``base_url``'s limits, registering them with ``requested``
    (``None`` fields inherit :data:`DEFAULT_LIMITS`) or checking ``requested`` against what
    is registered (a clash is a :class:`ValueError`: limits must agree process-wide)."""
    key = _registry_key(base_url)
    asked = {name: value for name, value in msgspec.structs.asdict(requested).items() if value is not None}
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            shared = SharedLimits(key, msgspec.structs.replace(DEFAULT_LIMITS, **asked), clock)
            _REGISTRY[key] = shared
        else:
            clash = {
                name: (value, getattr(shared.settings, name))
                for name, value in asked.items()
                if value != getattr(shared.settings, name)
            }
            if clash:
                detail = ", ".join(f"{n}={mine!r} (registered: {theirs!r})" for n, (mine, theirs) in clash.items())
                raise ConfigError(
                    f"judge limits for {key} are shared by every client in the process and are already "
                    f"registered with different values: {detail}. Configure every scorer that calls "
                    "this server with the same limits, or leave them unset to inherit."
                )
        shared.refs += 1
        return shared


def release_limits(shared: SharedLimits) -> None:
    """Drop one reference; the last one unregisters the limits."""
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs <= 0 and _REGISTRY.get(shared.key) is shared:
            del _REGISTRY[shared.key]


# --------------------------------------------------------------------------- quotas per experiment
_QUOTA: ContextVar[JudgeQuota | None] = ContextVar("prm_judge_quota", default=None)


@contextlib.contextmanager
def judge_quota(quota: JudgeQuota | None) -> Iterator[None]:
    """Within this block every judge client built takes ``quota``'s limits on each of its
    endpoints (``None``: no quota, also inside an outer block). What a client took at
    construction stays with it for its life."""
    if quota is not None and not isinstance(quota, JudgeQuota):
        raise TypeError(f"judge_quota takes a JudgeQuota or None, got {type(quota).__name__}")
    token = _QUOTA.set(quota)
    try:
        yield
    finally:
        _QUOTA.reset(token)


def active_quota() -> JudgeQuota | None:
    """The quota of the enclosing :func:`judge_quota` block, if any."""
    return _QUOTA.get()


class QuotaLimits(_Limiter):
    """One experiment's limits on one endpoint, shared by its clients in the process.

    Per event loop a semaphore (``max_in_flight``) and a pacer (``rps``), as
    :class:`SharedLimits`. Counters for the metrics: ``in_flight`` (attempts holding a
    quota slot; ``peak_in_flight`` the most at once), ``admitted`` (attempts that passed
    the quota), ``waited`` (of those, how many had to wait for it) and ``wait_s`` (the
    seconds they waited in total).
    """

    def __init__(self, quota: JudgeQuota, endpoint: str) -> None:
        super().__init__(quota.max_in_flight, quota.rps)
        self.quota = quota
        self.scope = quota.scope
        self.endpoint = endpoint  # the registry key of the endpoint's base_url
        self.refs = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.admitted = 0

    def _refusal(self, what: str) -> str:
        if what == "slot":
            return (
                f"experiment {self.scope!r} has no free judge slot (quota "
                f"max_in_flight={self.quota.max_in_flight} per endpoint)"
            )
        return f"experiment {self.scope!r}'s quota ({self.quota.rps:g} req/s per endpoint) leaves no slot"

    def __repr__(self) -> str:
        return f"QuotaLimits({self.quota!r}, endpoint={self.endpoint!r}, in_flight={self.in_flight})"


_QUOTAS: dict[tuple[str, str], QuotaLimits] = {}


def acquire_quota(quota: JudgeQuota | None, base_url: str) -> QuotaLimits | None:
    """Take a reference to ``quota``'s limits on ``base_url`` (``None`` when there is
    nothing to limit). Clients of one scope share its limits; a *different* quota for the
    scope (an experiment re-declared with new quotas) registers new limits that clients
    built from now on share, while the clients still open keep the old ones until they
    close (the old runner finishes its records under the quota it started with)."""
    if quota is None or quota.unlimited:
        return None
    key = (quota.scope, _registry_key(base_url))
    with _REGISTRY_LOCK:
        limits = _QUOTAS.get(key)
        if limits is None or limits.quota != quota:
            limits = _QUOTAS[key] = QuotaLimits(quota, key[1])
        limits.refs += 1
        return limits


def release_quota(limits: QuotaLimits) -> None:
    """Drop one reference; the last one unregisters the quota (and its metrics)."""
    with _REGISTRY_LOCK:
        limits.refs -= 1
        key = (limits.scope, limits.endpoint)
        if limits.refs <= 0 and _QUOTAS.get(key) is limits:
            del _QUOTAS[key]


def all_quotas() -> list[QuotaLimits]:
    """Every live :class:`QuotaLimits` of this process."""
    with _REGISTRY_LOCK:
        return list(_QUOTAS.values())
