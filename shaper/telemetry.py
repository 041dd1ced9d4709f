"""The trainer's Prometheus metrics: what its :class:`~shaper.consumer.VerdictConsumer` counted.

``prm-pipeline trainer --metrics-port P`` serves ``/metrics`` with

* ``prm_trainer_pipeline_total{counter}`` — every ``pipeline/<counter>`` of the consumer's
  totals (:class:`shaper.metrics.VerdictMetrics`), named as in the step lines and
  docs/trainer.md: ``verdicts/accepted``, ``verdicts/rejected/<reason>``,
  ``verdicts/duplicate``, ``groups/batched``, ``groups/dropped/...``, ``filter/stale``,
  the filter decisions ``filter/<counter>``;
* ``prm_trainer_steps_total``, ``prm_trainer_policy_version`` (the version the staleness
  bound compares with; absent until known), ``prm_trainer_max_policy_lag`` (absent when
  off), ``prm_trainer_buffered_groups``.

A collector reads the consumer at scrape time, so nothing is double-counted and the
training loop does no extra work per verdict.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from infra.ports import log_listening, port_unavailable
from shaper.metrics import COUNT_SUFFIX, PIPELINE_PREFIX

log = logging.getLogger(__name__)


class TrainerCollector(Collector):
    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.steps = 0

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self.consumer
        pipeline = CounterMetricFamily(
            "prm_trainer_pipeline", "The trainer consumer's pipeline/<counter> totals", labels=["counter"]
        )
        prefix = PIPELINE_PREFIX + "/"
        for key, value in sorted(c.totals().items()):
            if key.startswith(prefix) and not key.endswith(COUNT_SUFFIX):
                pipeline.add_metric([key[len(prefix) :]], value)
        yield pipeline
        steps = CounterMetricFamily("prm_trainer_steps", "Training steps taken")
        steps.add_metric([], float(self.steps))
        yield steps
        buffered = GaugeMetricFamily("prm_trainer_buffered_groups", "Accepted groups waiting for a batch")
        buffered.add_metric([], float(c.buffered_groups))
        yield buffered
        if c.policy_version is not None:
            version = GaugeMetricFamily("prm_trainer_policy_version", "The trainer's current policy version")
            version.add_metric([], float(c.policy_version))
            yield version
        if c.max_policy_lag is not None:
            bound = GaugeMetricFamily("prm_trainer_max_policy_lag", "trainer.max_policy_lag (the staleness bound)")
            bound.add_metric([], float(c.max_policy_lag))
            yield bound


class TrainerTelemetry:
    """Serve a consumer's counters on ``port`` (0: any free port) until :meth:`close`."""

    def __init__(self, consumer: Any) -> None:
        self.collector = TrainerCollector(consumer)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._server: Any = None
        self.port: int | None = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # one line naming the flag, exit 2 (prm_pipeline.cli), not a traceback
            raise port_unavailable(exc, host, port, "trainer --metrics-port") from None
        self.port = int(self._server.server_address[1])
        log_listening(log, "metrics", f"http://{host}:{self.port}/metrics")
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
