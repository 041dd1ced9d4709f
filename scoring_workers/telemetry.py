"""Worker counters, histograms and health, served over HTTP for Prometheus and Kubernetes.

``GET /metrics`` (Prometheus text format), ``GET /healthz`` (liveness: the worker's event
loop ticked recently) and ``GET /readyz`` (readiness: the consumer joined its group and
polls). Each :class:`WorkerTelemetry` owns its registry, so several workers in one
process (tests, benchmarks) never share counters.
"""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infra.ports import log_listening, port_unavailable
from infra.schema import GroupVerdict
from scoring_workers.judge_metrics import JudgeCollector

log = logging.getLogger(__name__)

LIVENESS_STALE_S = 30.0


class WorkerTelemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.consumed = Counter("prm_worker_consumed", "Records consumed", ["kind"], registry=r)
        self.scored = Counter("prm_worker_scored", "Trajectories scored successfully", registry=r)
        self.member_failures = Counter(
            "prm_worker_member_failures",
            "Members that failed scoring, by reason code (infra.reasons)",
            ["reason"],
            registry=r,
        )
        self.deduplicated = Counter(
            "prm_worker_deduplicated",
            "Records acknowledged without work (duplicate or group already decided)",
            registry=r,
        )
        self.dead_lettered = Counter(
            "prm_worker_dead_lettered", "Records sent to the dead-letter topic", ["error"], registry=r
        )
        self.verdicts = Counter(
            "prm_worker_verdicts",
            "Verdicts published, by status and reason code (infra.reasons; never the free-text reason)",
            ["status", "reason"],
            registry=r,
        )
        self.retries = Counter("prm_worker_retries", "Transient infrastructure errors retried", ["error"], registry=r)
        self.poison = Counter(
            "prm_worker_poison",
            "Records committed without a dead letter: Kafka refused the "
            "dead letter for good (the source topic keeps the record)",
            registry=r,
        )
        self.sweep_failures = Counter(
            "prm_worker_sweep_failures",
            "Groups (or whole sweeps) the sweeper could not handle this time; it goes on with the others",
            ["error"],
            registry=r,
        )
        self.publish_failures = Counter(
            "prm_worker_publish_failures",
            "Verdicts Kafka refused for good (they stay decided; the sweeper re-publishes them)",
            ["error"],
            registry=r,
        )
        self.finish_failures = Counter(
            "prm_worker_finish_failures",
            "Attempts to finish a group (cleanup after "
            "its verdict was acknowledged) that failed; retried with backoff while "
            "transient, else the sweeper finishes it",
            ["error"],
            registry=r,
        )
        self.probes = Counter(
            "prm_worker_probes",
            "Trajectories checked in the ledger before scoring (probed: a "
            "previous owner of the partition may have read them) or not (skipped)",
            ["kind"],
            registry=r,
        )
        self.commit_failures = Counter(
            "prm_worker_commit_failures",
            "Offset commits Kafka refused (e.g. a rebalance revoked the partition); the records are redelivered",
            ["error"],
            registry=r,
        )
        self.background_errors = Counter(
            "prm_worker_background_errors",
            "Unexpected failures of a periodic step (commit, sweep, lag); the worker goes on and the step runs again",
            ["step", "error"],
            registry=r,
        )
        self.scoring_seconds = Histogram(
            "prm_worker_scoring_seconds",
            "PRMRunner.run latency per trajectory",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.stage_seconds = Histogram(
            "prm_worker_stage_seconds",
            "Verdict latency by stage, per member: queue (published -> consumed), "
            "score (consumed -> scored), park (scored -> parked), wait (parked -> group decided), "
            "send (decided -> verdict acknowledged)",
            ["stage"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600),
        )
        self.in_flight = Gauge("prm_worker_in_flight", "Records being processed", registry=r)
        # Per experiment (docs/fleet.md): the label is an experiment the registry declared (or
        # "default"); a record naming an unknown one is counted under "unknown", never its id.
        self.experiment_records = Counter(
            "prm_worker_experiment_records",
            "Records consumed, by experiment and kind",
            ["experiment", "kind"],
            registry=r,
        )
        self.experiment_verdicts = Counter(
            "prm_worker_experiment_verdicts",
            "Verdicts published, by experiment and status",
            ["experiment", "status"],
            registry=r,
        )
        self.experiment_in_flight = Gauge(
            "prm_worker_experiment_in_flight", "Records being processed, by experiment", ["experiment"], registry=r
        )
        self.experiment_slots = Gauge(
            "prm_worker_experiment_slots",
            "In-flight slots the experiment may use now (its fair share, capped by its quota)",
            ["experiment"],
            registry=r,
        )
        self.experiments = Gauge(
            "prm_worker_experiments",
            "Experiments this worker serves, by state (active: scored; retiring: removed, open groups still scored)",
            ["state"],
            registry=r,
        )
        self.registry_records = Counter(
            "prm_worker_registry_records",
            "Experiment registry records applied, by outcome (declared, removed, refused)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("declared", "removed", "refused"):  # present (at 0) before the first record, for alerts
            self.registry_records.labels(outcome)
        self.lag = Gauge("prm_worker_consumer_lag", "highwater - committed offset", ["topic", "partition"], registry=r)
        Gauge(
            "prm_worker_ready",
            "1 once the consumer joined its group and polls (/readyz), 0 before and after",
            registry=r,
        ).set_function(lambda: 1.0 if self.ready else 0.0)
        r.register(JudgeCollector())  # the judge servers this process calls (none: nothing exported)

        self.last_tick = time.monotonic()
        self.ready = False
        self._server: ThreadingHTTPServer | None = None

    def observe_stages(self, verdict: GroupVerdict, sent_at: float) -> None:
        """Stage latencies of a published verdict's members (those that carry stage timestamps)."""
        for m in verdict.sessions:
            if not (m.parked_at and m.consumed_at):
                continue
            if m.created_at:
                self.stage_seconds.labels("queue").observe(max(0.0, m.consumed_at - m.created_at))
            if m.scored_at:
                self.stage_seconds.labels("score").observe(max(0.0, m.scored_at - m.consumed_at))
                self.stage_seconds.labels("park").observe(max(0.0, m.parked_at - m.scored_at))
            self.stage_seconds.labels("wait").observe(max(0.0, verdict.decided_at - m.parked_at))
        if verdict.decided_at:
            self.stage_seconds.labels("send").observe(max(0.0, sent_at - verdict.decided_at))

    def tick(self) -> None:
        """Called by the worker loop on every poll: proof of life for ``/healthz``."""
        self.last_tick = time.monotonic()

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics``, ``/healthz``, ``/readyz`` on ``port`` (0 = any) in a thread; returns the port."""
        telemetry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's naming
                if self.path == "/metrics":
                    self._reply(200, generate_latest(telemetry.registry), CONTENT_TYPE_LATEST)
                elif self.path == "/healthz":
                    alive = time.monotonic() - telemetry.last_tick < LIVENESS_STALE_S
                    self._reply(200 if alive else 503, b"ok\n" if alive else b"event loop stalled\n")
                elif self.path == "/readyz":
                    self._reply(200 if telemetry.ready else 503, b"ready\n" if telemetry.ready else b"starting\n")
                else:
                    self._reply(404, b"not found\n")

            def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # probes every few seconds: keep logs quiet
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # one line naming the setting, exit 2 (prm_pipeline.cli), not a traceback
            raise port_unavailable(
                exc, host, port, "worker --metrics-port (worker.metrics_port, PRM_WORKER_METRICS_PORT)"
            ) from None
        threading.Thread(target=self._server.serve_forever, name="prm-telemetry", daemon=True).start()
        bound = self._server.server_address[1]
        log_listening(log, "metrics", f"http://{host}:{bound}/metrics")
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

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
