"""The Grafana dashboard ``infra/deploy/grafana/prm-pipeline.json``, built in code with the
typed builders of ``grafana-foundation-sdk`` (the ``dev`` extra; nothing at run time imports
this module). ``python -m infra.monitoring`` writes the file; tests check it is current,
parses back into the SDK's typed model, and that every query returns data from a real
Prometheus scraping the pipeline.

:data:`PANELS` is the single list of panels and their queries, with the labels each
query's series must carry (the scrape test checks them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DATASOURCE_VAR = "datasource"
UID = "prm-pipeline"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    labels: tuple[str, ...] = ()  # labels every series of the result carries


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    row: str
    description: str = ""
    kind: str = "timeseries"  # or "stat"


def _q(expr: str, legend: str, *labels: str) -> Query:
    return Query(expr, legend, labels)


PANELS: tuple[PanelSpec, ...] = (
    # -- throughput and health
    PanelSpec(
        "Workers alive",
        "short",
        (_q("prm_pipeline_workers_alive", "alive"),),
        "Overview",
        "Workers whose Redis heartbeat is younger than 15 s (prm-pipeline status).",
        kind="stat",
    ),
    PanelSpec(
        "Pipeline healthy",
        "short",
        (_q("prm_pipeline_healthy", "healthy"),),
        "Overview",
        "1 when prm-pipeline status finds no critical problem.",
        kind="stat",
    ),
    PanelSpec(
        "Trajectories and verdicts per second",
        "ops",
        (
            _q("sum by (kind) (rate(prm_worker_consumed_total[1m]))", "consumed {{kind}}", "kind"),
            _q("sum by (status) (rate(prm_worker_verdicts_total[1m]))", "verdicts {{status}}", "status"),
        ),
        "Overview",
    ),
    PanelSpec(
        "Consumer lag",
        "short",
        (_q("sum by (role, topic) (prm_pipeline_consumer_lag)", "{{role}} {{topic}}", "role", "topic"),),
        "Overview",
        "Records not yet committed, per consumer group (workers on trajectories, trainer on verdicts).",
    ),
    # -- latency
    PanelSpec(
        "Verdict latency by stage (p50)",
        "s",
        (
            _q(
                "histogram_quantile(0.5, sum by (le, stage) (rate(prm_worker_stage_seconds_bucket[5m])))",
                "{{stage}}",
                "stage",
            ),
        ),
        "Latency",
        "queue: published -> consumed, score, park, wait: parked -> group decided, send.",
    ),
    PanelSpec(
        "Verdict latency by stage (p99)",
        "s",
        (
            _q(
                "histogram_quantile(0.99, sum by (le, stage) (rate(prm_worker_stage_seconds_bucket[5m])))",
                "{{stage}}",
                "stage",
            ),
        ),
        "Latency",
    ),
    PanelSpec(
        "Scoring time per trajectory",
        "s",
        (
            _q("histogram_quantile(0.5, sum by (le) (rate(prm_worker_scoring_seconds_bucket[5m])))", "p50"),
            _q("histogram_quantile(0.99, sum by (le) (rate(prm_worker_scoring_seconds_bucket[5m])))", "p99"),
        ),
        "Latency",
    ),
    # -- outcomes
    PanelSpec(
        "Verdicts by status",
        "short",
        (_q("sum by (status) (increase(prm_worker_verdicts_total[5m]))", "{{status}}", "status"),),
        "Outcomes",
    ),
    PanelSpec(
        "Verdicts per second by experiment",
        "ops",
        (
            _q(
                "sum by (experiment, status) (rate(prm_worker_experiment_verdicts_total[1m]))",
                "{{experiment}} {{status}}",
                "experiment",
                "status",
            ),
        ),
        "Outcomes",
        "One scoring fleet, many experiments (docs/fleet.md): each experiment's verdict rate.",
    ),
    PanelSpec(
        "Top reject and discard reasons (1h)",
        "short",
        (
            _q(
                'topk(10, sum by (status, reason) (increase(prm_worker_verdicts_total{status!="accepted"}[1h])))',
                "{{status}} {{reason}}",
                "status",
                "reason",
            ),
        ),
        "Outcomes",
    ),
    PanelSpec(
        "Dead letters",
        "short",
        (_q("sum by (error) (increase(prm_worker_dead_lettered_total[10m]))", "{{error}}", "error"),),
        "Outcomes",
        "Records sent to the dead-letter topic, by error class (docs/faults.md).",
    ),
    PanelSpec(
        "Open groups and oldest age",
        "short",
        (
            _q("prm_pipeline_unfinished_groups", "{{state}}", "state"),
            _q(
                "prm_pipeline_oldest_open_group_age_seconds / prm_pipeline_group_timeout_seconds",
                "oldest open / timeout",
            ),
        ),
        "Outcomes",
        "Groups in the Redis ledger; the oldest open group's age as a share of worker.group_timeout_s.",
    ),
    # -- judge
    PanelSpec(
        "Judge attempts and failures",
        "ops",
        (
            _q("sum by (endpoint) (rate(prm_judge_attempts_total[1m]))", "attempts {{endpoint}}", "endpoint"),
            _q("sum by (endpoint) (rate(prm_judge_attempt_failures_total[1m]))", "failures {{endpoint}}", "endpoint"),
        ),
        "Judge",
    ),
    PanelSpec(
        "Judge attempt latency",
        "s",
        (
            _q(
                "histogram_quantile(0.5, sum by (le, endpoint) (rate(prm_judge_attempt_seconds_bucket[5m])))",
                "p50 {{endpoint}}",
                "endpoint",
            ),
            _q(
                "histogram_quantile(0.99, sum by (le, endpoint) (rate(prm_judge_attempt_seconds_bucket[5m])))",
                "p99 {{endpoint}}",
                "endpoint",
            ),
        ),
        "Judge",
    ),
    PanelSpec(
        "Judge circuit breaker",
        "short",
        (
            _q(
                "max by (endpoint, state) (prm_judge_breaker_open)",
                "open {{endpoint}} ({{state}})",
                "endpoint",
                "state",
            ),
            _q("sum by (endpoint) (increase(prm_judge_breaker_opened_total[10m]))", "opened {{endpoint}}", "endpoint"),
        ),
        "Judge",
    ),
    # -- Redis
    PanelSpec(
        "Redis commands per second",
        "ops",
        (_q("topk(8, rate(prm_pipeline_redis_commands_total[1m]))", "{{command}}", "command"),),
        "Redis",
    ),
    PanelSpec(
        "Redis memory",
        "bytes",
        (
            _q("prm_pipeline_redis_used_memory_bytes", "used {{node}}", "node"),
            _q("prm_pipeline_redis_maxmemory_bytes > 0", "maxmemory {{node}}", "node"),
        ),
        "Redis",
    ),
    # -- trainer
    PanelSpec(
        "Trainer verdicts and drops",
        "short",
        (
            _q(
                'sum by (counter) (increase(prm_trainer_pipeline_total{counter=~"verdicts/.*|groups/.*"}[5m]))',
                "{{counter}}",
                "counter",
            ),
        ),
        "Trainer",
    ),
    PanelSpec(
        "Trainer filters and staleness drops",
        "short",
        (
            _q(
                'sum by (counter) (increase(prm_trainer_pipeline_total{counter=~"filter/.*"}[5m]))',
                "{{counter}}",
                "counter",
            ),
            _q("prm_trainer_policy_version", "policy version"),
        ),
        "Trainer",
        "Group-filter decisions and groups dropped by trainer.max_policy_lag (filter/stale).",
    ),
)


def build() -> Any:
    """The dashboard as the SDK's typed model."""
    from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    ds = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
    board = (
        dashboard.Dashboard("prm-pipeline")
        .uid(UID)
        .description(
            "Process-reward scoring over Kafka and Redis: throughput, lag, latency by stage, outcomes, "
            "judge, Redis and trainer. Alerts and runbook: docs/deploy.md."
        )
        .tags(["prm-pipeline"])
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable(DATASOURCE_VAR).label("Prometheus").type("prometheus"))
    )
    row = None
    for panel_id, spec in enumerate(PANELS, start=1):
        if spec.row != row:
            board = board.with_row(dashboard.Row(spec.row))
            row = spec.row
        panel: Any
        if spec.kind == "stat":
            panel = stat.Panel().reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"])).height(4).span(6)
        else:
            panel = (
                timeseries.Panel()
                .height(8)
                .span(12)
                .legend(
                    common.VizLegendOptions()
                    .display_mode(cm.LegendDisplayMode.LIST)
                    .placement(cm.LegendPlacement.BOTTOM)
                    .show_legend(True)
                )
                .tooltip(common.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
            )
        panel = panel.id(panel_id).title(spec.title).datasource(ds).unit(spec.unit)
        if spec.description:
            panel = panel.description(spec.description)
        for i, query in enumerate(spec.queries):
            panel = panel.with_target(
                prometheus.Dataquery()
                .expr(query.expr)
                .legend_format(query.legend)
                .ref_id(chr(ord("A") + i))
                .datasource(ds)
            )
        board = board.with_panel(panel)
    model = board.build()
    rows = [p for p in model.panels or [] if getattr(p, "type_val", None) == "row"]
    for i, row_panel in enumerate(rows, start=len(PANELS) + 1):  # the Row builder sets no id: give each its own
        row_panel.id_val = i
    return model


def dashboard_json() -> str:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
