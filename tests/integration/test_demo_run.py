"""Short real ``prm-pipeline demo`` runs: the report's learning curves are the verdicts' and the trainer's,
and a second run from the same seed trains on the same numbers.

The demo runs its own embedded broker, Redis, two worker processes, the model server
and the scripted judge; these tests read what it left beside the report —
``verdicts.jsonl`` (every verdict, from the verdicts topic) and ``trainer-log.jsonl``
(what the trainer trained on at each step) — recompute both runs' curves from each,
and compare them with the report's ``learning-curves.json`` and its first section.
The two demo runs are started together (each is mostly waiting on its own child
processes), with the smallest sizes that still race two workers for two groups per run
and update: the verdicts' arrival order then differs between the runs now and then.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prm_pipeline.demo.curves import RUNS, check_run, curves_from_trainer_log, curves_from_verdicts

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
DEMO_ARGS = ["--updates", "2", "--prompts", "2", "--group-size", "2", "--seed", "0"]


@pytest.fixture(scope="module")
def two_demo_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two demo runs with the same arguments and seed, side by side; each must exit 0 with ``demo OK``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    outs = [tmp_path_factory.mktemp("demo") / "report" for _ in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prm_pipeline.cli",
                "--config",
                str(REPO / "config" / "demo.yaml"),
                "demo",
                *DEMO_ARGS,
                "--out",
                str(out),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for out in outs
    ]
    try:
        results = [p.communicate(timeout=420) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert "demo OK" in stdout
    return outs[0], outs[1]


@pytest.mark.timeout(600)
def test_a_short_demo_reports_the_curves_its_verdicts_and_trainer_log_hold(two_demo_runs: tuple[Path, Path]) -> None:
    out = two_demo_runs[0]
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


@pytest.mark.timeout(600)
def test_a_demo_run_streams_its_sessions_and_reports_end_to_verdict(two_demo_runs: tuple[Path, Path]) -> None:
    out = two_demo_runs[0]
    streaming = json.loads((out / "streaming.json").read_text())
    # read back from the broker: 8 groups of 2 sessions of 3 turns (the runs) and the not-concat group's
    # 2 members of 2 turns and the lost group's one member of 3 turns, all streamed; 2 discards and the warm-up's
    assert streaming["trajectories_topic"] == {"discard": 3, "end": 16 + 2 + 1, "turn": 16 * 3 + 2 * 2 + 3}
    sessions, groups = streaming["end_to_verdict"]
    assert (sessions["over"], sessions["n"], groups["over"], groups["n"]) == ("sessions", 16, "groups", 8)
    for row in (sessions, groups):
        assert 0 < row["p50 (s)"] <= row["p99 (s)"] <= row["max (s)"] < 120, row
    assert groups["p99 (s)"] <= sessions["max (s)"]  # a group's last end is one of its sessions' ends
    page = (out / "index.html").read_text()
    latency = page.split("<section id='latency'>")[1].split("</section>")[0]
    assert "end -&gt; verdict" in latency and f"<td>{sessions['p50 (s)']:.4g}</td>" in latency
    assert "end -&gt; verdict over 16 sessions p50" in page.split("<section id='summary'>")[1]


def _trained_on(out: Path) -> dict[str, Any]:
    """What a run's training depended on and produced: the scores in its verdicts (outcomes, per-turn and
    per-token rewards of every accepted group) and its whole trainer log (outcomes, advantages, losses,
    ratios, gradient norms per step and run). Worker ids, timestamps and judge-call counts are left out."""
    scores = {}
    for line in (out / "verdicts.jsonl").read_text().splitlines():
        v = json.loads(line)
        if v["status"] != "accepted":
            continue
        scores[v["group_id"]] = sorted(
            (
                s["session_id"],
                s["outcome_reward"],
                [b["token_rewards"] for b in s["branches"]],
                sorted((t["interaction_id"], t["scorer_name"], t["reward"]) for t in s["turn_results"]),
            )
            for s in v["sessions"]
        )
    log = [json.loads(line) for line in (out / "trainer-log.jsonl").read_text().splitlines()]
    curves = json.loads((out / "learning-curves.json").read_text())
    return {"scores": scores, "trainer log": log, "curves": curves["curves"], "verdict": curves["verdict"]}


@pytest.mark.timeout(600)
def test_the_same_seed_reproduces_the_run(two_demo_runs: tuple[Path, Path]) -> None:
    a, b = (_trained_on(out) for out in two_demo_runs)
    assert len(a["scores"]) == 2 * len(RUNS) * 2 and len(a["trainer log"]) == 2 * len(RUNS)
    assert a["scores"] == b["scores"]
    assert a["trainer log"] == b["trainer log"]  # exact: same batches, same rows, same minibatches, same floats
    assert a["curves"] == b["curves"] and a["verdict"] == b["verdict"]
