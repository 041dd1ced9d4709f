"""Never silent, never stuck: what a new user following README.md and docs/ runs into.

* An experiment the registry does not declare is refused up front, in one line, by every
  tool that would publish to it or wait for its verdicts (no worker reads its topics).
* A record naming another experiment than its topic's (an undeclared one here) is a dead
  letter (``ExperimentMismatch``) that ``dead-letters`` shows and never redrives.
* A topic that does not exist is one line saying so and how to create it (no traceback,
  no ``kafka_unreachable``), and ``topics create`` creates declared experiments' topics.
* ``publish --raw`` makes a dead letter to try the tools on, and ``--offsets`` takes the
  ``dead_letter`` field as the listing prints it.
* ``audit --groups`` with a typo says so and exits 2; ``status`` piped is never cut.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from infra.config import PipelineConfig, PRMConfig, PRMScorerConfig
from infra.experiments import UnknownExperiment
from infra.kafka import ensure_topics, make_admin, make_producer
from infra.registry import ExperimentSpec, publish_spec
from infra.schema import encode
from prm_pipeline.demo.processes import write_config
from prm_pipeline.demo.synthetic import make_group
from shaper.reward_client import RewardClient
from tests.integration.harness import read_topic, running_worker, with_scorers

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "trajectories.jsonl")
LENGTH = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 32})


def _cli(
    config: Path, *args: str, timeout: float = 120, python: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *python, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


async def cli(config: Path, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(_cli, config, *args, **kwargs)


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The single line a refused command prints on stderr (no traceback, no log noise)."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


async def topics(cfg: PipelineConfig) -> set[str]:
    admin = make_admin(cfg.kafka)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


def _spec(experiment_id: str) -> ExperimentSpec:
    return ExperimentSpec(experiment_id=experiment_id, prm=PRMConfig(scorers=[LENGTH]))


async def test_an_undeclared_experiment_is_refused_up_front_by_every_tool(pipeline_config, tmp_path) -> None:
    cfg = pipeline_config
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    await publish_spec(cfg, _spec("exp-ok"))
    expected = (
        f"error: experiment 'nosuch' has no declaration in the registry {cfg.topics.experiments} "
        "(not declared; declared: exp-ok): no worker reads its topics, so nothing would ever be scored; "
        "declare it first with `prm-pipeline experiment add FILE.yaml`"
    )

    for args in (
        ("publish", "--experiment", "nosuch", EXAMPLE),
        ("trainer", "--experiment", "nosuch"),
        ("verdicts", "--experiment", "nosuch", "--idle-timeout", "1"),
        ("status", "--experiment", "nosuch"),
        ("inspect", "--group", "g1", "--experiment", "nosuch", "--wait", "1"),
    ):
        proc = await cli(config, *args)
        assert (proc.returncode, one_line(proc)) == (2, expected), args
    assert f"{cfg.topics.trajectories}.nosuch" not in await topics(cfg)  # nothing was published

    client = RewardClient(cfg, experiment="nosuch", verdict_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(UnknownExperiment, match="'nosuch' has no declaration"):
        await client.start()
    assert time.monotonic() - started < 30  # refused on start, not after the verdict timeout

    from prm_pipeline.gateway import serve

    gateway_cfg = msgspec.structs.replace(
        cfg,
        trainer=msgspec.structs.replace(cfg.trainer, experiment="nosuch"),
        gateway=msgspec.structs.replace(cfg.gateway, port=0),
    )
    with pytest.raises(UnknownExperiment, match="'nosuch' has no declaration"):
        await serve(gateway_cfg, asyncio.Event())

    await ensure_topics(cfg.kafka, cfg.topics, [f"{cfg.topics.trajectories}.exp-ok"])  # as `experiment add` does
    ok = await cli(config, "publish", "-q", "--experiment", "exp-ok", EXAMPLE)  # a declared one is published
    assert ok.returncode == 0 and ok.stdout.strip().endswith(f"to {cfg.topics.trajectories}.exp-ok"), ok.stderr


async def test_a_missing_topic_is_one_line_with_the_fix_and_topics_create_makes_experiment_topics(
    pipeline_config, tmp_path
) -> None:
    cfg = pipeline_config  # its topics do not exist yet
    config = write_config(cfg, tmp_path / "config.yaml")
    fix = "`prm-pipeline topics create` creates the configured topics and those of every experiment declared"

    dumped = await cli(config, "verdicts", "--idle-timeout", "1")
    assert dumped.returncode == 1
    assert one_line(dumped) == f"error: topic {cfg.topics.verdicts!r} does not exist; {fix} in the registry"

    status = await cli(config, "status", "--json", "--sample", "0.5")
    report = json.loads(status.stdout)
    problems = {p["check"]: p["message"] for p in report["problems"]}
    assert status.returncode == 1 and "kafka_unreachable" not in problems, problems
    assert "topic_missing" in problems and fix in problems["topic_missing"]

    created = await cli(config, "topics", "create")
    assert created.returncode == 0, created.stderr
    await publish_spec(cfg, _spec("exp-t"))
    again = await cli(config, "topics", "create")
    assert again.returncode == 0, again.stderr
    states = dict(reversed(line.split()) for line in again.stdout.splitlines())
    assert states[f"{cfg.topics.trajectories}.exp-t"] == states[f"{cfg.topics.verdicts}.exp-t"] == "created"
    assert states[cfg.topics.verdicts] == "exists"


async def test_records_naming_another_experiment_and_raw_lines_are_dead_letters_the_tools_show(
    pipeline_config, tmp_path
) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    config = write_config(cfg, tmp_path / "config.yaml")
    raw = tmp_path / "bad.jsonl"
    raw.write_text("not a trajectory\n")
    (member,) = make_group("lost-g", 2)[:1]
    async with running_worker(cfg, "w-never-silent"):
        published = await cli(config, "publish", "--raw", str(raw))  # docs/dead-letters.md's way to make one
        assert published.returncode == 0, published.stderr
        assert (
            published.stdout == f"published 1 raw records (unchecked, no key, no headers) to "
            f"{cfg.topics.trajectories}\n"
        )
        producer = make_producer(cfg.kafka)  # a producer of its own, naming an experiment nobody declared
        await producer.start()
        try:
            value, headers = encode(msgspec.structs.replace(member, experiment_id="never-declared"))
            await producer.send_and_wait(cfg.topics.trajectories, value, key=b"lost-g", headers=headers)
        finally:
            await producer.stop()
        letters = await read_topic(
            cfg, cfg.topics.dead_letters, until=time.monotonic() + 60, stop_when=lambda rs: len(rs) >= 2
        )
    assert len(letters) == 2

    listed = await cli(config, "dead-letters", "--experiment", "never-declared")
    assert listed.returncode == 0 and listed.stdout == "", listed.stdout  # a letter is its topic's experiment's

    everything = await cli(config, "dead-letters")
    (unknown,) = [
        x for x in map(json.loads, everything.stdout.splitlines()) if x["error_class"] == "ExperimentMismatch"
    ]
    assert (unknown["group_id"], unknown.get("experiment_id")) == ("lost-g", None)  # the default topic's
    assert "names experiment 'never-declared'" in unknown["error_message"]
    (bad,) = [x for x in map(json.loads, everything.stdout.splitlines()) if x["error_class"] != "ExperimentMismatch"]
    assert bad["error_class"] == "UnknownSchemaVersion" and bad["key"] is None

    # --offsets takes the dead_letter field exactly as the listing prints it
    plan = await cli(config, "dead-letters", "--redrive", "--offsets", unknown["dead_letter"])
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.startswith(
        f"skip    {unknown['dead_letter']}: trajectory {member.trajectory_id} of group lost-g;"
    )
    assert "it would be refused again" in plan.stdout and "would redrive 0 of 1" in plan.stdout
    skipped = await cli(config, "dead-letters", "--redrive", "--offsets", bad["dead_letter"])
    assert f"skip    {bad['dead_letter']}" in skipped.stdout and "would redrive 0 of 1" in skipped.stdout
    elsewhere = await cli(config, "dead-letters", "--redrive", "--offsets", "other.topic:0@1")
    assert elsewhere.returncode == 2 and "--offsets names ['other.topic']" in one_line(elsewhere)


async def test_audit_of_groups_none_of_which_exist_says_so_and_exits_2(pipeline_config, tmp_path) -> None:
    cfg = pipeline_config
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    proc = await cli(config, "audit", "--groups", "exmple-math", "--quiet")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "none of the --groups was found" in proc.stdout and "exmple-math" in proc.stdout


async def test_status_piped_is_neither_wrapped_nor_cut_and_imports_no_torch(pipeline_config, tmp_path) -> None:
    cfg = pipeline_config
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    proc = await cli(config, "status", "--sample", "0.5", python=("-X", "importtime"))
    assert proc.returncode in (0, 1), proc.stderr  # no worker runs here: unhealthy is expected
    assert "…" not in proc.stdout
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("workers (")]
    assert f"workers ({cfg.worker.group_id})" in row and cfg.topics.trajectories in row and len(row) > 100
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "prm_pipeline.status.collect" in imported and "torch" not in imported
