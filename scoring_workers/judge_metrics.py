"""The judge servers a worker calls, as Prometheus metrics (read at scrape time).

Per judge ``base_url`` (label ``endpoint``), from its process-wide limits
(:mod:`scoring_workers.scorers.judge_limits`): attempts, attempts the circuit breaker
counts as failures, attempt latency, requests on the wire, and the breaker — its state
(``prm_judge_breaker_open`` is 1 while open or half-open) and how often it opened.
Nothing is exported while no judge scorer is configured.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from scoring_workers.scorers.judge_limits import LATENCY_BUCKETS_S, all_limits


class JudgeCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        limits = all_limits()
        attempts = CounterMetricFamily("prm_judge_attempts", "HTTP attempts to the judge", labels=["endpoint"])
        failed = CounterMetricFamily("prm_judge_attempt_failures", "Attempts the circuit breaker counts as "
                                     "failures (timeouts, connection errors, HTTP 5xx)", labels=["endpoint"])
        latency = HistogramMetricFamily("prm_judge_attempt_seconds", "Duration of one HTTP attempt",
                                        labels=["endpoint"])
        in_flight = GaugeMetricFamily("prm_judge_in_flight", "Attempts on the wire", labels=["endpoint"])
        is_open = GaugeMetricFamily("prm_judge_breaker_open", "1 while the circuit breaker is open or half-open",
                                    labels=["endpoint", "state"])
        opened = CounterMetricFamily("prm_judge_breaker_opened", "Times the circuit breaker opened",
                                     labels=["endpoint"])
        for lim in limits:
            ep = [lim.key]
            attempts.add_metric(ep, lim.attempts)
            failed.add_metric(ep, lim.failed_attempts)
            buckets = [(str(b), float(n)) for b, n in zip(LATENCY_BUCKETS_S, lim.latency_buckets)]
            latency.add_metric(ep, [*buckets, ("+Inf", float(lim.attempts))], lim.latency_sum_s)
            in_flight.add_metric(ep, lim.in_flight)
            state = lim.breaker.state
            is_open.add_metric([lim.key, state], 0.0 if state == "closed" else 1.0)
            opened.add_metric(ep, lim.breaker.opened_count)
        if limits:
            yield from (attempts, failed, latency, in_flight, is_open, opened)
