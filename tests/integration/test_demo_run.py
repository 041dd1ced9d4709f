"""A short real ``prm-pipeline demo``: its report's learning curves are the verdicts' and the trainer's.

The demo runs its own embedded broker, Redis, two worker processes, the model server
and the scripted judge; this test reads what it left beside the report —
``verdicts.jsonl`` (every verdict, from the verdicts topic) and ``trainer-log.jsonl``
(what the trainer trained on at each step) — recomputes both runs' curves from each,
and compares them with the report's ``learning-curves.json`` and its first section.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prm_pipeline.demo.curves import RUNS, check_run, curves_from_trainer_log, curves_from_verdicts

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_a_short_demo_reports_the_curves_its_verdicts_and_trainer_log_hold(tmp_path: Path) -> None:
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(REPO / "config" / "demo.yaml"), "demo",
         "--updates", "2", "--prompts", "2", "--group-size", "2", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo OK" in proc.stdout
    assert check_run(out) == []
    verdicts = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    log = [json.loads(line) for line in (out / "trainer-log.jsonl").read_text().splitlines()]
    assert sorted((x["step"], x["run"]) for x in log) == [(s, r) for s in (1, 2) for r in sorted(RUNS)]
    from_verdicts, from_log = curves_from_verdicts(verdicts), curves_from_trainer_log(log)
    reported = {c["run"]: c for c in json.loads((out / "learning-curves.json").read_text())["curves"]}
    for run in RUNS:
        assert len(from_log[run].groups) == 2 and all(len(g) == 2 for g in from_log[run].groups)
        assert from_verdicts[run].mean == from_log[run].mean == reported[run]["mean"]
    # same seed: both runs sampled the same first rollouts
    assert from_log["outcome"].mean[0] == from_log["process"].mean[0]
    page = (out / "index.html").read_text()
    first = page.index("<section id=")
    assert page[first:].startswith("<section id='learning'>")
    assert json.loads((out / "learning-curves.json").read_text())["verdict"] in page.replace("&#x27;", "'")
