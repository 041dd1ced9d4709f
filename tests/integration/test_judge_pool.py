"""A judge pool through the real pipeline: three ``prm-pipeline fake-judge`` replicas, one
slowed 10x and one failing every request, behind one judge scorer of a worker on the
embedded broker and Redis.

Every vote is cast: each judged turn gets its ``m`` votes with no request error (a vote
that hit the failing replica was retried on another one), every group is accepted, and
the replicas together answered exactly the votes the verdicts count. The share of
calls each replica answered is printed (``-s``); the failing one answered none.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics
from producers.publisher import TrajectoryPublisher
from scoring_workers.judge_metrics import endpoint_snapshot
from scoring_workers.worker import Worker
from tests.integration.harness import isolated_config, wait_for_verdicts
from tests.integration.test_judge_pipeline import judged_trajectory

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
JUDGE = "openclaw_judge"
BASE_LATENCY_MS = 20.0
GROUPS, MEMBERS, JUDGED_TURNS, M = 16, 2, 3, 3


class Replica:
    """One ``prm-pipeline fake-judge`` process; :attr:`statuses` is read from its exit line."""

    def __init__(self, name: str, *args: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prm_pipeline.cli", "fake-judge", "--port", "0", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self.proc.stdout.readline()  # blocks until it serves (or dies)
        match = re.match(r"PRM_JUDGE_URL=(\S+)", line)
        if match is None:
            self.proc.kill()
            raise RuntimeError(f"fake-judge {name} did not start: {line!r} {self.proc.stdout.read()!r}")
        self.url = match.group(1)
        self.statuses: dict[int, int] = {}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        match = re.search(r"served (\d+) requests (\{.*\})", out)
        assert match, out
        self.statuses = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", match.group(2))}


@contextmanager
def replicas() -> Iterator[list[Replica]]:
    started: list[Replica] = []
    try:
        started.append(Replica("normal", "--latency", f"{BASE_LATENCY_MS / 1000:g}"))
        started.append(Replica("slow-10x", "--latency", f"{10 * BASE_LATENCY_MS / 1000:g}"))
        started.append(Replica("failing", "--latency", f"{BASE_LATENCY_MS / 1000:g}", "--error-rate", "1"))
        yield started
    finally:
        for r in started:
            if r.proc.poll() is None:
                r.stop()


def _config(kafka_bootstrap: str, redis_url: str, urls: list[str]) -> PipelineConfig:
    scorer = PRMScorerConfig(
        "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
        kwargs={
            "base_urls": urls,
            "model": "fake-judge",
            "temperature": 0.0,
            "max_tokens": 64,
            "m": M,
            "adaptive": False,
            "on_all_votes_failed": "reject",
            "timeout_s": 5.0,
            "total_timeout_s": 10.0,
            "max_retries": 2,
            "backoff_base_s": 0.05,
            "backoff_max_s": 0.2,
            "breaker_failure_threshold": 3,
            "breaker_reset_s": 1.0,
        },
    )
    name = f"pool-{uuid.uuid4().hex[:8]}"
    return isolated_config(
        name,
        kafka_bootstrap,
        redis_url,
        scorers=[scorer],
        scorer_timeout_s=30,
        group_timeout_s=120,
        allowed_scorer_modules=["scoring_workers.scorers"],
    )


def _observed(session, metric: str) -> list[float]:
    return [
        next(o.value for o in tr.observations if o.metric_id == metric)
        for tr in session.turn_results
        if tr.scorer_name == JUDGE
    ]


async def test_three_replicas_one_slow_one_failing_lose_no_vote(kafka_bootstrap: str, redis_url: str) -> None:
    with replicas() as pool:
        cfg = _config(kafka_bootstrap, redis_url, [r.url for r in pool])
        await ensure_topics(cfg.kafka, cfg.topics)
        worker = Worker(cfg, worker_id="w-pool")
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            groups = []
            for g in range(GROUPS):
                gid = f"pool-{g}-{uuid.uuid4().hex[:6]}"
                groups.append(gid)
                members = [
                    judged_trajectory(gid, f"{gid}-s{i}", MEMBERS, [("tool", "ok, success")] * JUDGED_TURNS)
                    for i in range(MEMBERS)
                ]
                async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                    await pub.publish_many(members)
            verdicts = {v.group_id: v for v in await wait_for_verdicts(cfg, groups, timeout_s=120)}
            seen = endpoint_snapshot()  # the worker's view of each replica (what /metrics exports)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        for r in pool:
            r.stop()
    assert sorted(verdicts) == sorted(groups)
    assert [g for g, v in verdicts.items() if v.status != "accepted"] == [], [
        (v.reason, [s.error for s in v.sessions]) for v in verdicts.values() if v.status != "accepted"
    ]
    calls = errors = 0
    for v in verdicts.values():
        for s in v.sessions:
            calls += sum(_observed(s, "judge_calls"))
            errors += sum(_observed(s, "judge_call_errors"))
    votes = GROUPS * MEMBERS * JUDGED_TURNS * M
    answered = {r.name: r.statuses.get(200, 0) for r in pool}
    shares = {name: round(n / votes, 3) for name, n in answered.items()}
    print(
        f"\njudge pool: {votes} votes, lost {int(errors)}; share of answered calls per replica {shares}; "
        f"HTTP statuses {[(r.name, r.statuses) for r in pool]}; routes "
        f"{[(r.name, dict(seen[r.url.removeprefix('http://')].routed)) for r in pool]}; latency EWMA "
        f"{[(r.name, seen[r.url.removeprefix('http://')].ewma_s) for r in pool]}"
    )
    assert (calls, errors) == (votes, 0)  # every vote cast, none lost
    assert sum(answered.values()) == votes  # each vote answered exactly once
    assert answered["failing"] == 0 and pool[2].statuses.get(500, 0) > 0  # it was tried, and routed around
    assert answered["normal"] > 0 and answered["slow-10x"] > 0
