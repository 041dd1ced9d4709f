"""The generated monitoring files (infra/monitoring): current, well-formed, linked to their runbook.

promtool and a real Prometheus check the rules' and the dashboard's PromQL in tests/ops
(``make test-ops``); this file needs neither.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from infra.monitoring.__main__ import DASHBOARD, PROMETHEUS_RULE, RULES, generated
from infra.monitoring.alerts import ALERTS, prometheus_rule, rules_file, slug
from infra.monitoring.dashboard import PANELS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_MD = ROOT / "docs" / "deploy.md"


def test_generated_files_are_current() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in generated().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"out of date, run `python -m infra.monitoring`: {stale}"


def test_both_rule_files_hold_the_same_rules() -> None:
    plain = yaml.safe_load(RULES.read_text())
    operator = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert plain == rules_file() and operator == prometheus_rule()
    assert operator["spec"] == plain
    names = [r["alert"] for r in plain["groups"][0]["rules"]]
    assert names == [a.name for a in ALERTS] and len(set(names)) == len(names)


def test_every_runbook_link_is_a_section_of_deploy_md() -> None:
    headings = [m.group(1) for m in re.finditer(r"^#{1,6} (.+)$", DEPLOY_MD.read_text(), re.M)]
    anchors = [slug(h) for h in headings]
    for alert in ALERTS:
        assert alert.runbook_url == f"docs/deploy.md#{alert.anchor}"
        assert anchors.count(alert.anchor) == 1, (
            f"{alert.name}: no (unique) section '{alert.runbook}' in docs/deploy.md"
        )
        assert alert.name in DEPLOY_MD.read_text(), f"{alert.name} is not in the alert table of docs/deploy.md"
    assert slug("`prm-pipeline status`") == "prm-pipeline-status"


def test_every_alert_summary_uses_only_labels_its_query_keeps() -> None:
    for alert in ALERTS:
        used = set(re.findall(r"\$labels\.(\w+)", alert.summary))
        assert used <= set(alert.labels), f"{alert.name}: summary uses {used - set(alert.labels)}"


def test_dashboard_parses_into_the_typed_model_and_back() -> None:
    raw = json.loads(DASHBOARD.read_text())
    model = Dashboard.from_json(raw)
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == raw  # nothing the SDK's schema does not know
    assert raw["uid"] == "prm-pipeline" and raw["templating"]["list"][0]["type"] == "datasource"


def test_dashboard_panels_are_laid_out_and_query_prometheus() -> None:
    raw = json.loads(DASHBOARD.read_text())
    panels = raw["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
    queries = [t for p in panels if p["type"] != "row" for t in p["targets"]]
    assert [t["expr"] for t in queries] == [q.expr for spec in PANELS for q in spec.queries]
    for t in queries:
        assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and t["refId"]
    titles = {p["title"] for p in panels}
    for wanted in (
        "Consumer lag",
        "Verdict latency by stage (p99)",
        "Dead letters",
        "Judge circuit breaker",
        "Redis memory",
        "Trainer filters and staleness drops",
        "Top reject and discard reasons (1h)",
    ):
        assert wanted in titles
