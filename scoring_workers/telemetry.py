"""Worker counters and histograms, exported in Prometheus format on ``/metrics``.

Each :class:`WorkerTelemetry` owns its registry, so several workers in one process (tests,
benchmarks) never share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class WorkerTelemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.consumed = Counter("prm_worker_consumed", "Records consumed", ["kind"], registry=r)
        self.scored = Counter("prm_worker_scored", "Trajectories scored successfully", registry=r)
        self.member_failures = Counter("prm_worker_member_failures", "Members that failed scoring", ["reason"], registry=r)
        self.deduplicated = Counter("prm_worker_deduplicated", "Records acknowledged without work (duplicate or group already decided)", registry=r)
        self.dead_lettered = Counter("prm_worker_dead_lettered", "Records sent to the dead-letter topic", ["error"], registry=r)
        self.verdicts = Counter("prm_worker_verdicts", "Verdicts published", ["status", "reason"], registry=r)
        self.retries = Counter("prm_worker_retries", "Transient infrastructure errors retried", ["error"], registry=r)
        self.scoring_seconds = Histogram(
            "prm_worker_scoring_seconds", "PRMRunner.run latency per trajectory", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.in_flight = Gauge("prm_worker_in_flight", "Records being processed", registry=r)
        self.lag = Gauge("prm_worker_consumer_lag", "highwater - committed offset", ["topic", "partition"], registry=r)

    def serve(self, port: int) -> None:
        """Expose ``/metrics`` on ``port`` (0 picks a free one) in a background thread."""
        start_http_server(port, registry=self.registry)

    def snapshot(self) -> dict[str, float]:
        """Flat ``name{labels}`` -> value, for logs and tests."""
        out: dict[str, float] = {}
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out
