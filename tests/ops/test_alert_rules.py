"""The generated alert rules through Prometheus' own tools (``make test-ops`` installs them):
``promtool check rules``, and ``promtool test rules`` with synthetic series that fire and
that do not fire each alert, expected labels and annotations included.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from infra.monitoring.__main__ import RULES
from infra.monitoring.alerts import ALERTS, GROUP_NAME, Alert

PROMTOOL = shutil.which("promtool")


@dataclass
class Case:
    alert: str
    fires: bool
    series: dict[str, str]  # series -> promtool values notation (one sample per minute)
    eval_at: str
    labels: dict[str, str] = field(default_factory=dict)  # labels of the firing alert beyond severity/service


LAG = 'prm_pipeline_consumer_lag{role="workers",group="prm-scoring-workers",topic="prm.trajectories",partition="%d"}'
LAG_LABELS = {"role": "workers", "group": "prm-scoring-workers", "topic": "prm.trajectories"}
JUDGE = 'prm_judge_breaker_open{endpoint="judge:30000",state="%s",instance="w0:9108"}'

CASES = [
    Case("PrmConsumerLagGrowing", True, {LAG % 0: "0+10x40", LAG % 1: "5x40"}, "20m", LAG_LABELS),
    Case("PrmConsumerLagGrowing", False, {LAG % 0: "100x40", LAG % 1: "5x40"}, "20m"),
    Case("PrmConsumerLagGrowing", False, {LAG % 0: "400-10x40"}, "20m"),  # draining: lag falls
    Case("PrmConsumerLagGrowing", False, {LAG % 0: "0+10x8 80x40"}, "20m"),  # grew, then stopped growing
    Case("PrmNoLiveWorker", True, {"prm_pipeline_workers_alive": "2 2 0x10"}, "8m"),
    Case("PrmNoLiveWorker", False, {"prm_pipeline_workers_alive": "2 2 0 2x10"}, "8m"),  # a blip, not 2 minutes
    Case(
        "PrmWorkerNotReady",
        True,
        {'prm_worker_ready{instance="w0:9108",job="workers"}': "0x10"},
        "6m",
        {"instance": "w0:9108", "job": "workers"},
    ),
    Case("PrmWorkerNotReady", False, {'prm_worker_ready{instance="w0:9108",job="workers"}': "0 0 1x10"}, "6m"),
    Case(
        "PrmOldestGroupNearTimeout",
        True,
        {"prm_pipeline_oldest_open_group_age_seconds": "500x5", "prm_pipeline_group_timeout_seconds": "600x5"},
        "3m",
    ),
    Case(
        "PrmOldestGroupNearTimeout",
        False,
        {"prm_pipeline_oldest_open_group_age_seconds": "400x5", "prm_pipeline_group_timeout_seconds": "600x5"},
        "3m",
    ),
    Case(
        "PrmDeadLetters",
        True,
        {'prm_worker_dead_lettered_total{error="SchemaError",instance="w0:9108"}': "0 0 3 3 3"},
        "3m",
        {"error": "SchemaError"},
    ),
    Case(
        "PrmDeadLetters",
        False,
        {'prm_worker_dead_lettered_total{error="SchemaError",instance="w0:9108"}': "3x30"},
        "25m",
    ),  # old dead letters, none in the last 10 minutes
    Case(
        "PrmRejectedShareHigh",
        True,
        {
            'prm_worker_verdicts_total{status="rejected",reason="missing_sessions"}': "0+5x40",
            'prm_worker_verdicts_total{status="accepted",reason=""}': "0+5x40",
        },
        "30m",
    ),
    Case(
        "PrmRejectedShareHigh",
        False,
        {
            'prm_worker_verdicts_total{status="rejected",reason="missing_sessions"}': "0+1x40",
            'prm_worker_verdicts_total{status="accepted",reason=""}': "0+9x40",
        },
        "30m",
    ),
    Case("PrmRejectedShareHigh", False, {'prm_worker_verdicts_total{status="accepted",reason=""}': "0+9x40"}, "30m"),
    Case("PrmJudgeBreakerOpen", True, {JUDGE % "open": "1x10"}, "5m", {"endpoint": "judge:30000"}),
    Case("PrmJudgeBreakerOpen", False, {JUDGE % "closed": "0x10"}, "5m"),
    Case(
        "PrmRedisMemoryNearMax",
        True,
        {
            'prm_pipeline_redis_used_memory_bytes{node="redis"}': "900x10",
            'prm_pipeline_redis_maxmemory_bytes{node="redis"}': "1000x10",
        },
        "7m",
        {"node": "redis"},
    ),
    Case(
        "PrmRedisMemoryNearMax",
        False,
        {
            'prm_pipeline_redis_used_memory_bytes{node="redis"}': "900x10",
            'prm_pipeline_redis_maxmemory_bytes{node="redis"}': "0x10",
        },
        "7m",
    ),  # no limit
    Case(
        "PrmRedisMemoryNearMax",
        False,
        {
            'prm_pipeline_redis_used_memory_bytes{node="redis"}': "500x10",
            'prm_pipeline_redis_maxmemory_bytes{node="redis"}': "1000x10",
        },
        "7m",
    ),
    Case("PrmTrainerDroppingStale", True, {'prm_trainer_pipeline_total{counter="filter/stale"}': "0 0 2 2"}, "3m"),
    Case(
        "PrmTrainerDroppingStale",
        False,
        {
            'prm_trainer_pipeline_total{counter="filter/stale"}': "0x5",
            'prm_trainer_pipeline_total{counter="verdicts/accepted"}': "0+5x5",
        },
        "3m",
    ),
    Case("PrmRegistryRecordRefused", True, {'prm_worker_registry_records_total{outcome="refused"}': "0 0 1 1"}, "3m"),
    Case(
        "PrmRegistryRecordRefused",
        False,
        {
            'prm_worker_registry_records_total{outcome="refused"}': "0x5",
            'prm_worker_registry_records_total{outcome="declared"}': "0 1 2 2 2",
        },
        "3m",
    ),
    Case("PrmStatusExporterDown", True, {'prm_pipeline_status_up{part="redis"}': "0x10"}, "6m", {"part": "redis"}),
    Case("PrmStatusExporterDown", False, {'prm_pipeline_status_up{part="redis"}': "1x10"}, "6m"),
]


def expected_alert(alert: Alert, labels: dict[str, str]) -> dict[str, dict[str, str]]:
    summary = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], alert.summary)
    return {
        "exp_labels": {"severity": alert.severity, "service": GROUP_NAME, **labels},
        "exp_annotations": {"summary": summary, "runbook": alert.runbook_url},
    }


def rule_tests(cases: list[Case], rules: Path) -> dict:
    by_name = {a.name: a for a in ALERTS}
    tests = []
    for case in cases:
        exp = [expected_alert(by_name[case.alert], case.labels)] if case.fires else []
        tests.append(
            {
                "name": f"{case.alert} {'fires' if case.fires else 'stays quiet'}",
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                "alert_rule_test": [{"eval_time": case.eval_at, "alertname": case.alert, "exp_alerts": exp}],
            }
        )
    return {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL, "promtool missing: run `make test-ops` (it installs the Debian package prometheus)"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules() -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_each_alert_fires_and_stays_quiet(tmp_path: Path) -> None:
    assert {c.alert for c in CASES if c.fires} == {a.name for a in ALERTS} == {c.alert for c in CASES if not c.fires}
    path = tmp_path / "rules.test.yaml"
    path.write_text(yaml.safe_dump(rule_tests(CASES, RULES), sort_keys=False))
    out = promtool("test", "rules", str(path))
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The harness is not vacuous: swapping a firing case's expectation makes promtool fail."""
    fires, quiet = CASES[0], CASES[1]
    assert fires.fires and not quiet.fires and fires.alert == quiet.alert
    wrong = [
        Case(fires.alert, False, fires.series, fires.eval_at),
        Case(quiet.alert, True, quiet.series, quiet.eval_at, fires.labels),
    ]
    path = tmp_path / "wrong.test.yaml"
    path.write_text(yaml.safe_dump(rule_tests(wrong, RULES), sort_keys=False))
    out = promtool("test", "rules", str(path))
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr
