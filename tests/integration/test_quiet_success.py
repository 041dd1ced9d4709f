"""Quiet success made visible: a re-published file is deduplicated *and says so*, ``verdicts``
counts repeated verdicts, and a trainer waiting for a batch says what it waits for."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from infra import jsonl
from infra.config import PRMScorerConfig, TrainerConfig
from infra.kafka import ensure_topics
from infra.schema import GroupVerdict
from prm_pipeline.demo.processes import write_config
from prm_pipeline.demo.synthetic import make_group
from tests.integration.harness import running_worker, wait_for_verdicts, with_scorers
from tests.integration.test_verdict_consumer import publish
from tests.polling import eventually

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _cli(config: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


async def test_republished_file_is_logged_and_the_trainer_says_what_it_waits_for(
    pipeline_config, tmp_path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="scoring_workers.settling")
    cfg = with_scorers(
        pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 4})
    )
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    group = make_group("quiet-g1", 2, turns=1, output_tokens=3)
    jsonl.write(tmp_path / "in.jsonl", group)

    async with running_worker(cfg, "w-quiet"):
        first = await asyncio.to_thread(_cli, config, "publish", str(tmp_path / "in.jsonl"))
        assert first.returncode == 0, first.stderr
        await wait_for_verdicts(cfg, ["quiet-g1"])
        second = await asyncio.to_thread(_cli, config, "publish", str(tmp_path / "in.jsonl"))
        assert second.returncode == 0, second.stderr
        wanted = {t.trajectory_id for t in group}
        await eventually(
            lambda: {
                t
                for r in caplog.records
                if "duplicate acknowledged" in r.getMessage()
                for t in wanted
                if f"traj={t}:" in r.getMessage()
            },
            accept=lambda logged: logged == wanted,
            timeout_s=30,
            interval_s=0.1,
            what=f"duplicates of {sorted(wanted)} to be logged",
        )

    # one group buffered, a batch of 8 wanted: the trainer says so, then trains on the partial batch
    waiting = write_config(
        msgspec.structs.replace(cfg, trainer=TrainerConfig(group_id=f"trainer-a.{cfg.topics.verdicts}", device="cpu")),
        tmp_path / "a.yaml",
    )
    ran = await asyncio.to_thread(_cli, waiting, "trainer", "--batch-groups", "8", "--idle-timeout", "7")
    assert ran.returncode == 0, ran.stderr
    assert "waiting for 7 more groups to fill a batch of 8 (1 buffered); a partial batch goes after 7s" in ran.stderr
    assert "trainer stopped (idle): 1 steps, 1 groups" in ran.stdout

    # the README's quick-session form: one step as soon as the group is read
    quick = write_config(
        msgspec.structs.replace(cfg, trainer=TrainerConfig(group_id=f"trainer-b.{cfg.topics.verdicts}", device="cpu")),
        tmp_path / "b.yaml",
    )
    ran = await asyncio.to_thread(_cli, quick, "trainer", "--batch-groups", "1", "--idle-timeout", "5")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("step 1") or "\nstep 1" in ran.stdout, ran.stdout
    assert "trainer stopped (idle): 1 steps, 1 groups" in ran.stdout


async def test_verdicts_summary_counts_repeated_verdicts(pipeline_config, tmp_path) -> None:
    config = write_config(pipeline_config, tmp_path / "config.yaml")
    await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    a = GroupVerdict(group_id="rep-a", status="discarded", reason="r")
    b = GroupVerdict(group_id="rep-b", status="discarded", reason="r")
    await publish(pipeline_config, [a, b, a])  # a re-published verdict, as after a worker crash
    dumped = await asyncio.to_thread(_cli, config, "verdicts", "--from-beginning", "--max", "3", "--idle-timeout", "20")
    assert dumped.returncode == 0, dumped.stderr
    assert len(dumped.stdout.splitlines()) == 3
    assert (
        "3 verdicts of 2 groups: 1 repeated an (experiment_id, group_id, verdict_version) already printed"
        in dumped.stderr
    )
