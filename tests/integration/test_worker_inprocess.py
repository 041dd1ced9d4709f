"""Worker behaviour that needs no second process: health/metrics endpoints, timeouts, allow-list."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid

import msgspec
import pytest

from infra.config import ActorConfig, AgentConfig, ConfigError, PipelineConfig, PRMConfig, PRMScorerConfig, RolloutConfig
from infra.kafka import ensure_topics
from prm_pipeline.demo.synthetic import make_group, make_session
from producers.publisher import TrajectoryPublisher
from scoring_workers.worker import Worker
from tests.integration.harness import wait_for_verdicts

pytestmark = pytest.mark.integration


def _with_scorers(cfg: PipelineConfig, *scorers: PRMScorerConfig, **worker: object) -> PipelineConfig:
    return msgspec.structs.replace(
        cfg,
        rollout=RolloutConfig(agent=AgentConfig(prm=PRMConfig(scorers=list(scorers)))),
        actor=ActorConfig(token_rewards_as_adv=True),
        worker=msgspec.structs.replace(cfg.worker, **worker),
    )


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except urllib.error.URLError:  # server already closed: certainly not ready
        return 0, ""


async def test_health_ready_and_metrics_endpoints(pipeline_config) -> None:
    cfg = _with_scorers(pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer"), metrics_port=0)
    await ensure_topics(cfg.kafka, cfg.topics)
    worker = Worker(cfg, worker_id="w-health")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 30)
        port = worker.metrics_port
        deadline = asyncio.get_running_loop().time() + 20
        while (ready := await asyncio.to_thread(_get, port, "/readyz"))[0] != 200:  # until the group is joined
            assert ready == (503, "starting\n")
            assert asyncio.get_running_loop().time() < deadline, "never became ready"
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(_get, port, "/healthz") == (200, "ok\n")
        gid = f"h-{uuid.uuid4().hex[:6]}"
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(make_group(gid, 1, turns=1, output_tokens=8))
        await wait_for_verdicts(cfg, [gid])
        # the verdict is on the topic a moment before the worker counts it: poll the counter
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            status, body = await asyncio.to_thread(_get, port, "/metrics")
            assert status == 200
            if 'prm_worker_verdicts_total{reason="",status="accepted"} 1.0' in body:
                break
            assert asyncio.get_running_loop().time() < deadline, body
            await asyncio.sleep(0.05)
        assert "prm_worker_scoring_seconds_count 1.0" in body
        assert (await asyncio.to_thread(_get, port, "/nope"))[0] == 404
        stop.set()
        deadline = asyncio.get_running_loop().time() + 20
        while (await asyncio.to_thread(_get, port, "/readyz"))[0] == 200:  # not ready once stopping
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_hanging_scorer_times_out_and_rejects_the_group(pipeline_config) -> None:
    cfg = _with_scorers(pipeline_config, PRMScorerConfig("tests.scorers.SlowScorer"), scorer_timeout_s=0.5)
    await ensure_topics(cfg.kafka, cfg.topics)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(cfg, worker_id="w-timeout").run(stop))
    try:
        gid = f"hang-{uuid.uuid4().hex[:6]}"
        hang = make_session(trajectory_id=f"{gid}-1", session_id=f"{gid}-HANG", group_id=gid, group_size=2,
                            turns=1, output_tokens=4)
        ok = make_session(trajectory_id=f"{gid}-2", session_id=f"{gid}-fine", group_id=gid, group_size=2,
                          turns=1, output_tokens=4)
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many([hang, ok])
        (verdict,) = await wait_for_verdicts(cfg, [gid], timeout_s=30)
        assert verdict.status == "rejected" and verdict.reason == "scorer_timeout"
        assert {s.trajectory_id: s.status for s in verdict.sessions} == {f"{gid}-1": "failed", f"{gid}-2": "scored"}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_scorer_outside_the_allow_list_is_refused_at_start(pipeline_config) -> None:
    cfg = _with_scorers(pipeline_config, PRMScorerConfig("tests.scorers.SlowScorer"),
                        allowed_scorer_modules=["scoring_workers.scorers"])
    with pytest.raises(ConfigError, match="'tests.scorers.SlowScorer' is refused"):
        await Worker(cfg).run(asyncio.Event())


async def test_dead_letter_payloads_are_size_capped(pipeline_config) -> None:
    from infra.kafka import make_producer
    from infra.schema import dead_letter_from_record
    from tests.integration.harness import read_topic

    cfg = _with_scorers(pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer"),
                        dead_letter_max_bytes=1024)
    await ensure_topics(cfg.kafka, cfg.topics)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(cfg.topics.trajectories, b"\xc1" * 5000, key=b"big-junk",
                                     headers=[("prm-schema-version", b"1"), ("prm-kind", b"ready")])
    finally:
        await producer.stop()
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(cfg, worker_id="w-dlq").run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + 30
        records = []
        while not records:
            assert asyncio.get_running_loop().time() < deadline, "no dead letter within 30s"
            records = await read_topic(cfg, cfg.topics.dead_letters)
        (letter,) = [dead_letter_from_record(r.value, r.headers) for r in records]
        assert len(letter.payload) == 1024 and letter.payload == b"\xc1" * 1024
        assert letter.original_size == 5000 and letter.error_class == "InvalidMessage"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
