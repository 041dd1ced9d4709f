"""``prm-pipeline status --watch S --metrics-port P``: the latest report as Prometheus gauges.

The workers export what they do (``prm_worker_*``) and the trainer what it consumes
(``prm_trainer_*``); what only a view from outside sees comes from here: the lag of
every partition of both consumer groups (also partitions no live member owns), group
membership, the Redis ledger's open groups and the oldest one's age, Redis memory. The
alert rules (:mod:`infra.monitoring.alerts`) and the dashboard read these names.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from prm_pipeline.status.report import StatusReport


class StatusCollector(Collector):
    """Serves the most recent :class:`StatusReport` (set with :meth:`update`)."""

    def __init__(self) -> None:
        self._report: StatusReport | None = None
        self._lock = threading.Lock()

    def update(self, report: StatusReport) -> None:
        with self._lock:
            self._report = report

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            report = self._report
        up = GaugeMetricFamily(
            "prm_pipeline_status_up",
            "1 when the last status read each part (kafka, redis, dead_letters, verdicts) successfully",
            labels=["part"],
        )
        for part in ("kafka", "redis", "dead_letters", "verdicts"):
            up.add_metric([part], 0.0 if report is None or part in report.errors else 1.0)
        yield up
        if report is None:
            return
        healthy = GaugeMetricFamily("prm_pipeline_healthy", "1 when prm-pipeline status finds no critical problem")
        healthy.add_metric([], 1.0 if report.healthy else 0.0)
        yield healthy
        problems = GaugeMetricFamily(
            "prm_pipeline_problem", "1 per problem prm-pipeline status reports", labels=["check", "severity"]
        )
        for problem in report.problems:
            problems.add_metric([problem.check, problem.severity], 1.0)
        yield problems
        lag = GaugeMetricFamily(
            "prm_pipeline_consumer_lag",
            "Records not yet committed by the group, per partition",
            labels=["role", "group", "topic", "partition"],
        )
        members = GaugeMetricFamily(
            "prm_pipeline_consumer_group_members", "Live members of the consumer group", labels=["role", "group"]
        )
        for g in report.lags:
            for p in g.partitions:
                lag.add_metric([g.role, g.group, g.topic, str(p.partition)], float(p.lag))
            if g.members is not None:
                members.add_metric([g.role, g.group], float(g.members))
        yield lag
        yield members
        if report.workers is not None:
            alive = GaugeMetricFamily("prm_pipeline_workers_alive", "Workers whose Redis heartbeat is recent")
            alive.add_metric([], float(len(report.workers.alive)))
            yield alive
        ledger = report.ledger
        if ledger is not None:
            groups = GaugeMetricFamily(
                "prm_pipeline_unfinished_groups",
                "Groups in the Redis ledger not yet finished (of the sampled soonest-due ones)",
                labels=["state"],
            )
            for state in ("open", "decided"):
                groups.add_metric([state], float(getattr(ledger, state)))
            yield groups
            oldest = GaugeMetricFamily(
                "prm_pipeline_oldest_open_group_age_seconds", "Age of the oldest open group (0 when none is open)"
            )
            oldest.add_metric([], ledger.oldest_open_age_s or 0.0)
            yield oldest
            timeout = GaugeMetricFamily("prm_pipeline_group_timeout_seconds", "worker.group_timeout_s")
            timeout.add_metric([], ledger.group_timeout_s)
            yield timeout
            used = GaugeMetricFamily("prm_pipeline_redis_used_memory_bytes", "Redis used_memory", labels=["node"])
            limit = GaugeMetricFamily(
                "prm_pipeline_redis_maxmemory_bytes", "Redis maxmemory (0: unlimited)", labels=["node"]
            )
            for node in ledger.memory:
                used.add_metric([node.node], float(node.used_bytes))
                limit.add_metric([node.node], float(node.max_bytes))
            yield used
            yield limit
            commands = CounterMetricFamily(
                "prm_pipeline_redis_commands",
                "Redis calls per command (INFO commandstats, every client of that Redis)",
                labels=["command"],
            )
            for command, calls in sorted(ledger.redis_commands.items()):
                commands.add_metric([command], float(calls))
            yield commands


def status_registry(collector: StatusCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
