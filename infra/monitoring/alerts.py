"""The alert rules, defined once: rendered as a plain Prometheus rules file
(``infra/deploy/prometheus/rules.yaml``) and as a Prometheus Operator ``PrometheusRule``
(``infra/deploy/k8s/prometheusrule.yaml``) by ``python -m infra.monitoring``.

Each :class:`Alert` is a ``query`` (what is measured, with the labels an operator needs)
compared with a threshold. Keeping the query apart lets the tests check, against a real
Prometheus scraping the pipeline, that every query returns series with the expected
labels even when nothing fires. Every alert links its runbook: a section of
docs/deploy.md ("Runbook") that says what to do.

Metric sources: ``prm_worker_*`` and ``prm_judge_*`` from the workers, ``prm_trainer_*``
from the trainer (``--metrics-port``), ``prm_pipeline_*`` from ``prm-pipeline status
--watch S --metrics-port P`` (the view from outside: lag of every partition, heartbeats,
the ledger's oldest open group, Redis memory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

RUNBOOK_DOC = "docs/deploy.md"
GROUP_NAME = "prm-pipeline"


@dataclass(frozen=True)
class Alert:
    name: str
    query: str  # the measured value; the alert fires where ``query op threshold`` holds for ``for_``
    op: Literal[">", ">=", "==", "<"]
    threshold: float
    for_: str
    severity: Literal["critical", "warning"]
    summary: str  # may use {{ $labels.<label> }} of ``labels``
    labels: tuple[str, ...]  # labels the query's series carry (checked against a real Prometheus)
    runbook: str  # heading of the runbook section in docs/deploy.md

    @property
    def expr(self) -> str:
        return f"({self.query}) {self.op} {self.threshold:g}"

    @property
    def anchor(self) -> str:
        return slug(self.runbook)

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_DOC}#{self.anchor}"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


LAG_WINDOW = "5m"  # lag rose over this window ...
LAG_FOR = "10m"  # ... in every evaluation for this long
REJECTED_SHARE = 0.2
NEAR_TIMEOUT = 0.8
REDIS_MEMORY_SHARE = 0.8

ALERTS: tuple[Alert, ...] = (
    Alert(
        "PrmConsumerLagGrowing",
        f"sum by (role, group, topic) (delta(prm_pipeline_consumer_lag[{LAG_WINDOW}]))",
        ">",
        0,
        LAG_FOR,
        "warning",
        "{{ $labels.role }} lag on {{ $labels.topic }} has been growing for " + LAG_FOR,
        ("role", "group", "topic"),
        "Consumer lag growing",
    ),
    Alert(
        "PrmNoLiveWorker",
        "prm_pipeline_workers_alive",
        "==",
        0,
        "2m",
        "critical",
        "no scoring worker has beaten in Redis for 2 minutes",
        (),
        "No live worker",
    ),
    Alert(
        "PrmWorkerNotReady",
        "prm_worker_ready",
        "==",
        0,
        "5m",
        "warning",
        "worker {{ $labels.instance }} has not been ready for 5 minutes",
        ("instance",),
        "Worker not ready",
    ),
    Alert(
        "PrmOldestGroupNearTimeout",
        "max(prm_pipeline_oldest_open_group_age_seconds / prm_pipeline_group_timeout_seconds)",
        ">",
        NEAR_TIMEOUT,
        "1m",
        "warning",
        f"the oldest open group is past {NEAR_TIMEOUT:.0%} of worker.group_timeout_s",
        (),
        "Oldest group near its timeout",
    ),
    Alert(
        "PrmDeadLetters",
        "sum by (error) (increase(prm_worker_dead_lettered_total[10m]))",
        ">",
        0,
        "0m",
        "warning",
        "records dead-lettered in the last 10 minutes: {{ $labels.error }}",
        ("error",),
        "Dead letters",
    ),
    Alert(
        "PrmRejectedShareHigh",
        '(sum(rate(prm_worker_verdicts_total{status="rejected"}[10m])) or vector(0))'
        " / sum(rate(prm_worker_verdicts_total[10m]))",
        ">",
        REJECTED_SHARE,
        "15m",
        "warning",
        f"more than {REJECTED_SHARE:.0%} of verdicts are rejected",
        (),
        "Rejected share high",
    ),
    Alert(
        "PrmJudgeBreakerOpen",
        "max by (endpoint) (prm_judge_breaker_open)",
        ">",
        0,
        "2m",
        "critical",
        "the judge circuit breaker for {{ $labels.endpoint }} is open",
        ("endpoint",),
        "Judge breaker open",
    ),
    Alert(
        "PrmRedisMemoryNearMax",
        "max by (node) (prm_pipeline_redis_used_memory_bytes / (prm_pipeline_redis_maxmemory_bytes > 0))",
        ">",
        REDIS_MEMORY_SHARE,
        "5m",
        "critical",
        f"Redis {{{{ $labels.node }}}} is above {REDIS_MEMORY_SHARE:.0%} of maxmemory",
        ("node",),
        "Redis memory near maxmemory",
    ),
    Alert(
        "PrmTrainerDroppingStale",
        'sum(increase(prm_trainer_pipeline_total{counter="filter/stale"}[10m]))',
        ">",
        0,
        "0m",
        "warning",
        "the trainer dropped groups older than trainer.max_policy_lag",
        (),
        "Trainer dropping stale groups",
    ),
    Alert(
        "PrmRegistryRecordRefused",
        'sum(increase(prm_worker_registry_records_total{outcome="refused"}[10m]))',
        ">",
        0,
        "0m",
        "warning",
        "a worker refused an experiment registry record in the last 10 minutes (see its log)",
        (),
        "Experiment registry record refused",
    ),
    Alert(
        "PrmStatusExporterDown",
        "min by (part) (prm_pipeline_status_up)",
        "==",
        0,
        "5m",
        "warning",
        "prm-pipeline status cannot read {{ $labels.part }}",
        ("part",),
        "Status exporter cannot read",
    ),
)


def _rule(alert: Alert) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": alert.name, "expr": alert.expr}
    if alert.for_ != "0m":
        rule["for"] = alert.for_
    rule["labels"] = {"severity": alert.severity, "service": GROUP_NAME}
    rule["annotations"] = {"summary": alert.summary, "runbook": alert.runbook_url}
    return rule


def rules_file() -> dict[str, Any]:
    """The plain Prometheus rules file (``rule_files:``)."""
    return {"groups": [{"name": GROUP_NAME, "rules": [_rule(a) for a in ALERTS]}]}


def prometheus_rule() -> dict[str, Any]:
    """The same rules as a Prometheus Operator ``PrometheusRule`` (monitoring.coreos.com/v1)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": GROUP_NAME,
            "labels": {"app.kubernetes.io/name": "prm-pipeline", "app.kubernetes.io/component": "alerts"},
        },
        "spec": rules_file(),
    }
