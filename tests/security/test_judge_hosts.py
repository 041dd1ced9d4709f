"""Trajectories go only to judge hosts the operator allowed (``worker.allowed_judge_hosts``).

* ``prm-pipeline worker`` whose config names a judge outside an explicit list stops
  before it connects to anything, with one ``config error:`` line naming the key and
  the host (never the URL's path or user info);
* a worker built in process (the embedded broker and Redis) refuses the same config at
  start-up, and the judge outside the list never receives a request;
* the default (no list) keeps every existing config working: the worker scores with
  the judge its own file names.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from infra.config import ActorConfig, AgentConfig, ConfigError, PRMConfig, PRMScorerConfig, RolloutConfig
from infra.kafka import ensure_topics
from infra.local import free_port
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from prm_pipeline.demo.processes import write_config
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from scoring_workers.worker import Worker
from tests.integration.harness import wait_for_verdicts
from tests.security.conftest import ROOT

pytestmark = pytest.mark.integration

OPENCLAW = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"


def _with_judge(cfg, urls: list[str], allowed: list[str] | None):
    scorer = PRMScorerConfig(
        OPENCLAW,
        kwargs={
            "base_urls": urls,
            "model": "fake",
            "temperature": 0.0,
            "m": 1,
            "max_retries": 0,
            "on_all_votes_failed": "neutral",
        },
    )
    return msgspec.structs.replace(
        cfg,
        rollout=RolloutConfig(agent=AgentConfig(prm=PRMConfig(scorers=[scorer]))),
        actor=ActorConfig(token_rewards_as_adv=True),
        worker=msgspec.structs.replace(cfg.worker, allowed_judge_hosts=allowed),
    )


def test_worker_cli_refuses_a_judge_outside_the_list_before_connecting(pipeline_config, tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"  # no broker there: the command must not get as far as waiting for one
    cfg = _with_judge(
        pipeline_config,
        ["http://judge-0:30000", "http://ops:hunter2@judge.evil.example/t/s3cret"],
        ["judge-0", "*.judges.svc"],
    )
    cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap=dead))
    path = write_config(cfg, tmp_path / "config.yaml")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(path), "worker"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out
    assert out.splitlines() == [out] and "Traceback" not in out, out
    assert out.startswith("config error: rollout.agent.prm.scorers[0].kwargs.base_urls[1]: judge URL"), out
    assert "'judge.evil.example:80' is not in worker.allowed_judge_hosts ['judge-0', '*.judges.svc']" in out
    assert "hunter2" not in out and "s3cret" not in out
    assert time.monotonic() - t0 < 60  # refused at once, not after a connection timeout


async def test_in_process_worker_refuses_and_the_judge_hears_nothing(pipeline_config) -> None:
    with FakeJudgeServer() as outside:
        cfg = _with_judge(pipeline_config, [outside.base_url], ["judge.internal"])
        with pytest.raises(ConfigError, match=r"host '127\.0\.0\.1:\d+' is not in worker.allowed_judge_hosts"):
            await asyncio.wait_for(Worker(cfg).run(asyncio.Event()), 60)
        assert outside.requests == 0


async def test_the_default_keeps_the_files_own_judges_working(pipeline_config) -> None:
    with FakeJudgeServer() as a, FakeJudgeServer() as b:
        cfg = _with_judge(pipeline_config, [a.base_url, b.base_url], None)
        await ensure_topics(cfg.kafka, cfg.topics)
        worker = Worker(cfg, worker_id="w-hosts")
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            gid = f"hosts-{uuid.uuid4().hex[:6]}"
            async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                await pub.publish_many(make_group(gid, 2, turns=2, output_tokens=8))
            (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=60) if v.group_id == gid]
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        assert verdict.status == "accepted", verdict.reason
        assert a.requests + b.requests > 0
