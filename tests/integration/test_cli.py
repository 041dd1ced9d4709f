"""The CLI as a user runs it: publish a JSONL file, score, dump verdicts as JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from infra import jsonl
from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics, make_admin
from prm_pipeline.demo.processes import write_config
from prm_pipeline.demo.synthetic import make_group
from scoring_workers.worker import Worker
from tests.integration.harness import demo_config_on, with_scorers

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _cli(config, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


async def test_publish_jsonl_then_dump_verdicts(pipeline_config, tmp_path) -> None:
    cfg = with_scorers(
        pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 4})
    )
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group("cli-g1", 2, turns=1, output_tokens=3)
    # cli-g2 expects two members and gets one, then a discard: incomplete, so discarded
    # whatever order the worker's tasks run in
    jsonl.write(tmp_path / "in.jsonl", [*group, make_group("cli-g2", 2, turns=1, output_tokens=3)[0]])
    with (tmp_path / "in.jsonl").open("a") as f:
        f.write('{"kind": "discard", "group_id": "cli-g2", "reason": "not needed"}\n')

    published = await asyncio.to_thread(_cli, config, "publish", str(tmp_path / "in.jsonl"))
    assert published.returncode == 0, published.stderr
    assert "published 3 ready trajectories and 1 discards" in published.stdout

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "discard", "group_id": "x"}\n{"kind": "ready", "trajectory_id": 5}\n')
    refused = await asyncio.to_thread(_cli, config, "publish", str(bad))
    assert refused.returncode == 1 and "bad.jsonl:2:" in refused.stderr  # nothing sent: all lines validated first

    stop = asyncio.Event()
    worker = asyncio.create_task(Worker(cfg, worker_id="w-cli").run(stop))
    try:
        dumped = await asyncio.to_thread(
            _cli, config, "verdicts", "--from-beginning", "--max", "2", "--idle-timeout", "30", timeout=90
        )
    finally:
        stop.set()
        await worker
    assert dumped.returncode == 0, dumped.stderr
    lines = [json.loads(line) for line in dumped.stdout.splitlines()]
    by_group = {v["group_id"]: v for v in lines}
    assert set(by_group) == {"cli-g1", "cli-g2"}
    assert by_group["cli-g2"]["status"] == "discarded" and by_group["cli-g2"]["reason"] == "not needed"
    accepted = by_group["cli-g1"]
    assert accepted["status"] == "accepted"
    session = accepted["sessions"][0]
    assert {"session_id", "trajectory_id", "status", "outcome_reward", "branches"} <= session.keys()
    (branch,) = session["branches"]
    assert list(branch["token_rewards"].values()) == [[1.0, 1.0, 1.0]]  # 3 tokens within a budget of 4
    assert branch["scorer_totals"] == {"length_budget": 1.0}


def test_worker_with_kafka_but_no_redis_names_redis_and_its_setting(kafka_bootstrap) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRM_")}
    env.update(
        PRM_KAFKA_BOOTSTRAP=kafka_bootstrap,
        PRM_REDIS_URL=f"redis://user:s3cret@127.0.0.1:{port}/0",
        PRM_REDIS_STARTUP_TIMEOUT_S="4",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "worker"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Unclosed" not in proc.stderr and "s3cret" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in line and "PRM_REDIS_URL" in line
    assert "Kafka" not in line and "not reachable (attempt 2" in proc.stderr


async def test_readme_manual_session_with_the_example_file(pipeline_config, tmp_path) -> None:
    """README's manual session: demo.yaml's scorers, examples/trajectories.jsonl, a CLI worker."""
    cfg = demo_config_on(pipeline_config)
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)

    published = await asyncio.to_thread(_cli, config, "publish", str(REPO / "examples" / "trajectories.jsonl"))
    assert published.returncode == 0, published.stderr
    assert "published 3 ready trajectories and 1 discards" in published.stdout

    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "prm_pipeline.cli", "worker", "--config", str(config), "--worker-id", "w-example"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        dumped = await asyncio.to_thread(
            _cli, config, "verdicts", "--from-beginning", "--max", "2", "--idle-timeout", "60", timeout=120
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        await asyncio.to_thread(worker.wait, 60)
        log.close()
    assert dumped.returncode == 0, dumped.stderr
    assert worker.returncode == 0, (tmp_path / "worker.log").read_text()
    by_group = {v["group_id"]: v for v in map(json.loads, dumped.stdout.splitlines())}
    assert set(by_group) == {"example-math", "example-dropped"}

    dropped = by_group["example-dropped"]
    assert dropped["status"] == "discarded"
    assert dropped["reason"] == "environment crashed before the second session finished"

    math_group = by_group["example-math"]
    assert math_group["status"] == "accepted" and math_group["reason"] == ""
    sessions = {s["trajectory_id"]: s for s in math_group["sessions"]}
    branching, linear = sessions["example-math-t1"], sessions["example-math-t2"]
    assert [(b["leaf_id"], b["path"]) for b in branching["branches"]] == [
        ("s1-i2", ["s1-i1", "s1-i2"]),
        ("s1-i3", ["s1-i1", "s1-i3"]),
    ]
    assert [b["path"] for b in linear["branches"]] == [["s2-i1", "s2-i2"]]
    # every turn is within demo.yaml's 128-token budget: 1.0 per output token, per branch
    assert branching["branches"][0]["token_rewards"] == {"s1-i1": [1.0, 1.0], "s1-i2": [1.0, 1.0, 1.0]}
    assert branching["branches"][1]["token_rewards"] == {"s1-i1": [1.0, 1.0], "s1-i3": [1.0, 1.0]}
    assert (branching["outcome_reward"], linear["outcome_reward"]) == (1.0, 0.0)
    assert branching["stats"]["rollout/prm_turn_reward/length_budget"] == pytest.approx(1.0)


def _on_a_terminal(config, *args: str) -> tuple[int, str]:
    """Run the CLI with stdout on a pseudo-terminal; return its exit code and what it drew."""
    import pty

    main, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        stdout=secondary,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "150"},
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    return proc.wait(60), b"".join(chunks).decode(errors="replace")


async def test_publish_shows_progress_on_a_terminal_only(pipeline_config, tmp_path) -> None:
    config = write_config(pipeline_config, tmp_path / "config.yaml")
    await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    jsonl.write(tmp_path / "in.jsonl", [m for g in range(20) for m in make_group(f"p{g}", 2, turns=1, output_tokens=3)])
    code, drawn = await asyncio.to_thread(_on_a_terminal, config, "publish", str(tmp_path / "in.jsonl"))
    assert code == 0 and "published 40 ready trajectories" in drawn
    assert "validating" in drawn and "40/40" in drawn and "records/s" in drawn
    code, quiet = await asyncio.to_thread(_on_a_terminal, config, "publish", "--quiet", str(tmp_path / "in.jsonl"))
    assert code == 0 and "validating" not in quiet and "records/s" not in quiet
    piped = await asyncio.to_thread(_cli, config, "publish", str(tmp_path / "in.jsonl"))
    assert piped.stdout == f"published 40 ready trajectories and 0 discards to {pipeline_config.topics.trajectories}\n"


# --------------------------------------------------------------------------- ports, addresses, topics
FIX = "`prm-pipeline topics create` creates the configured topics"


def _timed(
    config, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )
    return proc, time.monotonic() - started


def _error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in proc.stderr and "Unclosed" not in proc.stderr, proc.stderr
    return [ln for ln in proc.stderr.splitlines() if ln.startswith(("error:", "config error:"))]


async def test_a_missing_topic_is_one_line_with_the_fix_within_5_s_from_every_command_and_never_created(
    pipeline_config, tmp_path
) -> None:
    cfg = with_scorers(
        pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 4})
    )
    config = write_config(cfg, tmp_path / "config.yaml")
    t = cfg.topics
    example = str(REPO / "examples" / "trajectories.jsonl")
    for args, topic in [
        (("publish", example), t.trajectories),
        (("publish", "--raw", example), t.trajectories),
        (("worker",), t.trajectories),
        (("verdicts", "--idle-timeout", "1"), t.verdicts),
        (("dead-letters",), t.dead_letters),
        (("inspect", "--group", "g1", "--wait", "1"), t.verdicts),
        (("audit",), t.trajectories),
        (("trainer", "--idle-timeout", "1"), t.verdicts),
        (("gateway", "--port", "0"), t.trajectories),
    ]:
        proc, took = await asyncio.to_thread(_timed, config, *args)
        assert proc.returncode in (1, 2), (args, proc.stderr)
        (line,) = _error_lines(proc)
        assert line.startswith(f"error: topic {topic!r} does not exist; {FIX}"), (args, line)
        assert took < 5, (args, took)
    admin = make_admin(cfg.kafka)
    await admin.start()
    try:
        assert not {t.trajectories, t.verdicts, t.dead_letters} & set(await admin.list_topics())  # none auto-created
    finally:
        await admin.close()


async def test_topics_create_reports_an_existing_topic_whose_partitions_differ(pipeline_config, tmp_path) -> None:
    cfg = pipeline_config
    two = msgspec.structs.replace(cfg.topics, partitions=2)
    await ensure_topics(cfg.kafka, two, [cfg.topics.trajectories])  # as an auto-created or older topic would be
    proc, _ = await asyncio.to_thread(_timed, write_config(cfg, tmp_path / "config.yaml"), "topics", "create")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        f"differs  {cfg.topics.trajectories}: 2 partitions, the config asks for {cfg.topics.partitions}"
        in "\n".join(lines)
    ), proc.stdout
    assert f"created  {cfg.topics.verdicts}" in lines


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


async def test_a_taken_port_is_one_line_naming_the_flag_exit_2(pipeline_config, tmp_path, taken_port) -> None:
    cfg = pipeline_config
    await ensure_topics(cfg.kafka, cfg.topics)
    config = write_config(cfg, tmp_path / "config.yaml")
    for args, flag in [
        (("gateway", "--port", str(taken_port)), "gateway --host/--port"),
        (("worker", "--metrics-port", str(taken_port)), "worker --metrics-port"),
        (("status", "--watch", "1", "--metrics-port", str(taken_port)), "status --metrics-port"),
        (("fake-judge", "--host", "0.0.0.0", "--port", str(taken_port)), "fake-judge --port"),
    ]:
        proc, _ = await asyncio.to_thread(_timed, config, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        (line,) = _error_lines(proc)
        assert line.startswith(f"config error: {flag}") and f":{taken_port}: the port is already in use" in line, line


@pytest.mark.parametrize(
    ("variable", "value"),
    [("PRM_KAFKA_BOOTSTRAP", "localhost"), ("PRM_KAFKA_BOOTSTRAP", ""), ("PRM_REDIS_URL", "localhost:6379")],
)
def test_a_malformed_address_is_a_config_error_at_once_naming_the_variable(variable, value, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRM_")}
    env[variable] = value
    proc, took = _timed(write_config(PipelineConfig(), tmp_path / "config.yaml"), "worker", env=env)
    assert proc.returncode == 2, proc.stderr
    (line,) = _error_lines(proc)
    assert line.startswith("config error:") and f"{variable}={value!r}" in line and "://?" not in line, line
    assert took < 5 and "not reachable" not in proc.stderr  # never retried as if the service were down
