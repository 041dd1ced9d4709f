"""The judge servers a worker calls, as Prometheus metrics (read at scrape time).

Per judge endpoint (label ``endpoint`` = ``host:port``, never the URL: its path, query
or user info may carry a secret; two roots on one ``host:port`` are summed), from its
process-wide limits (:mod:`scoring_workers.judge.limits`): attempts, attempts
the circuit breaker counts as failures, attempt latency, requests on the wire, the
load and recent latency a judge pool routes by, how pool calls were routed (``prm_judge_routed``, label
``route``: ``affinity`` / ``detour`` / ``spill`` / ``failover`` / ``balanced``, see
:mod:`scoring_workers.judge.pool`), and the breaker — its state
(``prm_judge_breaker_open`` is 1 while open or half-open) and how often it opened.
Per experiment quota (labels ``scope`` — the experiment id — and ``endpoint``; see
:class:`~scoring_workers.judge.limits.JudgeQuota`): attempts admitted, those
that had to wait for the quota and the seconds they waited, attempts holding a quota
slot now. Nothing is exported while no judge scorer is configured, and no quota
series (only the families' descriptions) while no client with a quota is open.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from scoring_workers.judge.hosts import endpoint_label
from scoring_workers.judge.limits import LATENCY_BUCKETS_S, QuotaLimits, SharedLimits, all_limits, all_quotas

_STATE_RANK = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(slots=True)
class _Endpoint:
    attempts: int = 0
    failed: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    latency_sum_s: float = 0.0
    in_flight: int = 0
    load: int = 0
    routed: Counter[str] = field(default_factory=Counter)
    state: str = "closed"
    opened: int = 0
    ewma_s: float | None = None

    def add(self, lim: SharedLimits) -> None:
        self.attempts += lim.attempts
        self.failed += lim.failed_attempts
        self.buckets = [a + b for a, b in zip(self.buckets, lim.latency_buckets)]
        self.latency_sum_s += lim.latency_sum_s
        self.in_flight += lim.in_flight
        self.load += lim.load
        self.routed.update(lim.routed)
        state = lim.breaker.state
        if _STATE_RANK.get(state, 0) > _STATE_RANK.get(self.state, 0):
            self.state = state  # the worst breaker of the endpoint's roots
        self.opened += lim.breaker.opened_count
        if lim.latency_ewma_s is not None:
            self.ewma_s = max(self.ewma_s or 0.0, lim.latency_ewma_s)


@dataclass(slots=True)
class _Quota:
    in_flight: int = 0
    admitted: int = 0
    waited: int = 0
    wait_s: float = 0.0

    def add(self, quota: QuotaLimits) -> None:
        self.in_flight += quota.in_flight
        self.admitted += quota.admitted
        self.waited += quota.waited
        self.wait_s += quota.wait_s


def quota_snapshot(quotas: list[QuotaLimits] | None = None) -> dict[tuple[str, str], _Quota]:
    """``(scope, host:port)`` -> the summed state of that experiment's quotas there."""
    out: dict[tuple[str, str], _Quota] = {}
    for quota in all_quotas() if quotas is None else quotas:
        out.setdefault((quota.scope, endpoint_label(quota.endpoint)), _Quota()).add(quota)
    return out


def endpoint_snapshot(limits: list[SharedLimits] | None = None) -> dict[str, _Endpoint]:
    """``host:port`` -> the summed state of its judge roots (all live ones by default)."""
    out: dict[str, _Endpoint] = {}
    for lim in all_limits() if limits is None else limits:
        out.setdefault(endpoint_label(lim.key), _Endpoint()).add(lim)
    return out


class JudgeCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        endpoints = endpoint_snapshot()
        attempts = CounterMetricFamily("prm_judge_attempts", "HTTP attempts to the judge", labels=["endpoint"])
        failed = CounterMetricFamily(
            "prm_judge_attempt_failures",
            "Attempts the circuit breaker counts as failures (timeouts, connection errors, HTTP 5xx)",
            labels=["endpoint"],
        )
        latency = HistogramMetricFamily(
            "prm_judge_attempt_seconds", "Duration of one HTTP attempt", labels=["endpoint"]
        )
        in_flight = GaugeMetricFamily("prm_judge_in_flight", "Attempts on the wire", labels=["endpoint"])
        load = GaugeMetricFamily(
            "prm_judge_load",
            "Attempts routed to the endpoint and not finished (waiting "
            "for a slot or on the wire): what a judge pool balances",
            labels=["endpoint"],
        )
        ewma = GaugeMetricFamily(
            "prm_judge_latency_ewma_seconds",
            "Recent answer latency (EWMA) a judge pool weighs the endpoint's load by",
            labels=["endpoint"],
        )
        routed = CounterMetricFamily(
            "prm_judge_routed",
            "Judge pool attempts by endpoint and route (affinity: "
            "the session's replica; detour: its next, the first one's breaker being open; "
            "spill: the least-loaded, the session's being overloaded; failover: a retry "
            "elsewhere; balanced: no session)",
            labels=["endpoint", "route"],
        )
        is_open = GaugeMetricFamily(
            "prm_judge_breaker_open", "1 while the circuit breaker is open or half-open", labels=["endpoint", "state"]
        )
        opened = CounterMetricFamily(
            "prm_judge_breaker_opened", "Times the circuit breaker opened", labels=["endpoint"]
        )
        for label, ep in sorted(endpoints.items()):
            attempts.add_metric([label], ep.attempts)
            failed.add_metric([label], ep.failed)
            buckets = [(str(b), float(n)) for b, n in zip(LATENCY_BUCKETS_S, ep.buckets)]
            latency.add_metric([label], [*buckets, ("+Inf", float(ep.attempts))], ep.latency_sum_s)
            in_flight.add_metric([label], ep.in_flight)
            load.add_metric([label], ep.load)
            if ep.ewma_s is not None:
                ewma.add_metric([label], ep.ewma_s)
            for route, count in sorted(ep.routed.items()):
                routed.add_metric([label, route], count)
            is_open.add_metric([label, ep.state], 0.0 if ep.state == "closed" else 1.0)
            opened.add_metric([label], ep.opened)
        if endpoints:
            yield from (attempts, failed, latency, in_flight, load, ewma, routed, is_open, opened)
        yield from _quota_families(quota_snapshot(), described=bool(endpoints))


def _quota_families(
    quotas: dict[tuple[str, str], _Quota],
    *,
    described: bool = False,
) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The quota series; with ``described`` (a judge is configured) the families are exported
    without series too, so dashboards and the metrics' metadata know them before any quota."""
    if not quotas and not described:
        return
    labels = ["scope", "endpoint"]
    admitted = CounterMetricFamily(
        "prm_judge_quota_admitted", "Judge attempts an experiment's quota admitted", labels=labels
    )
    waited = CounterMetricFamily(
        "prm_judge_quota_waited",
        "Of those, attempts that waited for the experiment's quota (its max_in_flight or rps on the endpoint)",
        labels=labels,
    )
    wait_s = CounterMetricFamily(
        "prm_judge_quota_wait_seconds", "Seconds attempts waited for the experiment's quota", labels=labels
    )
    in_flight = GaugeMetricFamily(
        "prm_judge_quota_in_flight",
        "Attempts holding a slot of the experiment's quota (waiting for a process-wide slot or on the wire)",
        labels=labels,
    )
    for key, q in sorted(quotas.items()):
        admitted.add_metric(list(key), q.admitted)
        waited.add_metric(list(key), q.waited)
        wait_s.add_metric(list(key), q.wait_s)
        in_flight.add_metric(list(key), q.in_flight)
    yield from (admitted, waited, wait_s, in_flight)
