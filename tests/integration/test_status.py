"""``prm-pipeline status`` against the real broker and Redis (standalone and Redis Cluster).

* A healthy run: two worker processes score published groups; ``status --json`` exits 0
  with both workers alive, no lag and the verdicts' rate and latency.
* Then both workers are killed (SIGKILL: no clean leave) while a producer keeps
  publishing: ``status`` exits 1 naming the silent workers and the growing lag.
* The ledger's view (open groups and the oldest one's age against its own timeout,
  decided groups awaiting their verdict, heartbeats, Redis memory) read from a real
  ledger on standalone Redis and on a one-node Redis Cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from infra.config import PipelineConfig, PRMScorerConfig, RedisConfig
from infra.kafka import ensure_topics, make_producer
from infra.schema import GroupVerdict, SessionResult, encode
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from prm_pipeline.demo.synthetic import make_session
from prm_pipeline.status.collect import ledger_summary, verdict_summary
from prm_pipeline.status.report import StatusReport, assess
from producers.publisher import TrajectoryPublisher
from scoring_workers.heartbeat import ALIVE_S
from scoring_workers.ledger import GroupLedger
from tests.integration.harness import isolated_config, wait_for_verdicts
from tests.integration.test_ledger import cluster_url  # noqa: F401 - the one-node Redis Cluster fixture
from tests.polling import poll_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCORERS = [PRMScorerConfig(path="scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 128})]


def status(config: Path, *args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), "status", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


async def publish(cfg: PipelineConfig, prefix: str, groups: int, *, size: int = 2) -> list[str]:
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        for g in range(groups):
            for m in range(size):
                await pub.publish_ready(
                    make_session(
                        trajectory_id=f"{prefix}{g}-{m}",
                        session_id=f"{prefix}{g}-{m}",
                        group_id=f"{prefix}{g}",
                        group_size=size,
                        turns=2,
                        output_tokens=8,
                    )
                )
    return [f"{prefix}{g}" for g in range(groups)]


def checks(report: dict) -> set[str]:
    return {p["check"] for p in report["problems"]}


async def test_status_healthy_then_workers_killed_with_growing_lag(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    cfg = isolated_config(unique_name, kafka_bootstrap, redis_url, scorers=SCORERS, group_timeout_s=60)
    config = write_config(cfg, tmp_path / "status.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    procs = WorkerProcesses(config, tmp_path, n=2)
    procs.start()
    try:
        await wait_for_verdicts(cfg, await publish(cfg, "ok", 12), timeout_s=90)

        async def settled() -> tuple[int, dict, dict]:  # both workers beat once ready, and commit what they finished
            code, report = await asyncio.to_thread(status, config)
            workers = next(g for g in report["lags"] if g["role"] == "workers")
            return code, report, workers

        def is_settled(got: tuple[int, dict, dict]) -> bool:
            code, report, workers = got
            return code == 0 and len(report["workers"]["alive"]) == 2 and workers["total"] == 0

        _, _, (code, report, workers) = await poll_until(settled, timeout_s=30, interval_s=0, accept=is_settled)
        assert code == 0, report["problems"]
        assert report["healthy"] is True and not checks(report) & {
            "no_live_worker",
            "lag_growing",
            "group_near_timeout",
        }
        assert sorted(w["worker_id"] for w in report["workers"]["alive"]) == ["w0.1", "w1.1"]
        assert workers["total"] == 0 and len(workers["partitions"]) == cfg.topics.partitions
        assert report["verdicts"]["count"] == 12 and report["verdicts"]["by_status"] == {"accepted": 12}
        assert report["verdicts"]["latency_p50_s"] > 0 and set(report["verdicts"]["stage_p50_s"]) >= {"score", "send"}
        assert report["dead_letters"]["count"] == 0

        procs.kill(0)
        procs.kill(1)
        killed_at = time.monotonic()

        async def keep_publishing() -> None:
            i = 0
            while True:
                await publish(cfg, f"late{i}-", 3)
                i += 1
                await asyncio.sleep(0.2)

        feeder = asyncio.create_task(keep_publishing())
        try:
            await asyncio.sleep(max(0.0, ALIVE_S + 1 - (time.monotonic() - killed_at)))  # the last beats age out
            code, report = await asyncio.to_thread(status, config, "--sample", "3")
        finally:
            feeder.cancel()
        assert code == 1 and report["healthy"] is False
        assert {"no_live_worker", "lag_growing"} <= checks(report), report["problems"]
        assert sorted(w["worker_id"] for w in report["workers"]["silent"]) == ["w0.1", "w1.1"]
        growing = next(g for g in report["lags"] if g["role"] == "workers")
        assert growing["growth"] > 0 and growing["produced"] >= growing["growth"]
    finally:
        procs.stop()


@pytest.fixture(params=["standalone", "cluster"])
def redis_cfg(request: pytest.FixtureRequest, redis_url: str) -> RedisConfig:
    if request.param == "cluster":
        return RedisConfig(
            url=request.getfixturevalue("cluster_url"), cluster=True, key_prefix=f"st{uuid.uuid4().hex[:6]}", ttl_s=60
        )
    return RedisConfig(url=redis_url, key_prefix=f"status-{uuid.uuid4().hex[:6]}", ttl_s=60)


async def test_ledger_view_on_standalone_and_cluster(
    redis_cfg: RedisConfig, kafka_bootstrap: str, unique_name: str
) -> None:
    cfg = isolated_config(unique_name, kafka_bootstrap, redis_cfg.url, group_timeout_s=600)
    cfg = msgspec.structs.replace(cfg, redis=redis_cfg)
    ledger = GroupLedger.from_config(redis_cfg)
    try:

        def member(tid: str) -> SessionResult:
            return SessionResult(session_id=tid, trajectory_id=tid, status="scored", outcome_reward=1.0)

        park = {"group_size": 2, "worker_id": "w", "scorers": b""}
        await ledger.park(member("old-0"), group_id="old", group_timeout_s=2.0, **park)  # short timeout: soon near it
        await ledger.park(member("young-0"), group_id="young", group_timeout_s=600.0, **park)
        await ledger.park(member("done-0"), group_id="done", group_timeout_s=600.0, **park)
        decided = await ledger.decide(
            "done", "discard", worker_id="w", scorers=b"", group_timeout_s=600.0, republish_grace_s=5.0
        )
        assert decided.outcome == "decided_now"  # decided, its verdict never published
        await ledger.view.beat("w-alive")
        await ledger.view.beat("w-gone")
        await ledger.view.retire("w-gone")

        summary, workers = await ledger_summary(cfg)
        assert (summary.indexed, summary.open, summary.decided) == (3, 2, 1)
        assert summary.oldest_open_group == "old" and summary.oldest_open_timeout_s == pytest.approx(2.0)
        assert summary.memory and all(n.used_bytes > 0 for n in summary.memory)
        assert [w.worker_id for w in workers.alive] == ["w-alive"] and not workers.silent
        assert "group_near_timeout" not in {
            p.check for p in assess(StatusReport(at=0, ledger=summary, workers=workers))
        }

        summary = (
            await poll_until(
                lambda: ledger_summary(cfg),
                timeout_s=10,
                interval_s=0.1,
                accept=lambda got: got[0].oldest_open_age_s >= 1.7,
            )
        ).last[0]
        problems = {p.check: p for p in assess(StatusReport(at=0, ledger=summary, workers=workers))}
        assert "group_near_timeout" in problems and "old" in problems["group_near_timeout"].message
    finally:
        await ledger.aclose()


async def test_top_reasons_are_reason_codes_never_free_text(
    kafka_bootstrap: str, redis_url: str, unique_name: str
) -> None:
    """Rejected and discarded verdicts are summarised by their ``reason_code``: a discard's
    own words (or a failed member's detail) never become a 'reason' of the summary."""
    cfg = isolated_config(unique_name, kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    verdicts = [
        GroupVerdict(group_id="d1", status="discarded", reason_code="discarded", reason="environment crashed at t3"),
        GroupVerdict(group_id="d2", status="discarded", reason_code="discarded", reason="prompt filtered: too long"),
        GroupVerdict(
            group_id="r1",
            status="rejected",
            reason_code="scorer_timeout",
            reason="scorer_timeout: member 't1' (session 's1'): took 31 s",
        ),
        GroupVerdict(group_id="a1", status="accepted"),
    ]
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for v in verdicts:
            value, headers = encode(v)
            await producer.send(cfg.topics.verdicts, value, key=v.group_id.encode(), headers=headers)
        await producer.flush()
    finally:
        await producer.stop()
    summary = await verdict_summary(cfg, window_s=600, timeout_s=30)
    assert summary.count == 4 and summary.by_status == {"discarded": 2, "rejected": 1, "accepted": 1}
    assert dict(summary.top_reasons) == {"discarded": 2, "scorer_timeout": 1}
