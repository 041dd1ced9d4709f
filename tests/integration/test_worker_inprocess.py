"""Worker behaviour that needs no second process: health/metrics endpoints, timeouts, allow-list."""

from __future__ import annotations

import asyncio
import logging
import urllib.request
import uuid

import pytest

from infra.config import ConfigError, PRMScorerConfig
from infra.kafka import ensure_topics
from prm_pipeline.demo.synthetic import make_group, make_session
from producers.publisher import TrajectoryPublisher
from scoring_workers.worker import Worker
from tests.integration.harness import wait_for_verdicts, with_scorers
from tests.polling import eventually

pytestmark = pytest.mark.integration


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except urllib.error.URLError:  # server already closed: certainly not ready
        return 0, ""


async def test_health_ready_and_metrics_endpoints(pipeline_config) -> None:
    cfg = with_scorers(pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer"), metrics_port=0)
    await ensure_topics(cfg.kafka, cfg.topics)
    worker = Worker(cfg, worker_id="w-health")
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 30)
        port = worker.metrics_port

        async def readyz() -> tuple[int, str]:
            got = await asyncio.to_thread(_get, port, "/readyz")
            assert got[0] == 200 or got == (503, "starting\n")
            return got

        async def metrics() -> str:
            status, body = await asyncio.to_thread(_get, port, "/metrics")
            assert status == 200
            return body

        await eventually(readyz, accept=lambda got: got[0] == 200, timeout_s=20, what="ready (the group joined)")
        assert await asyncio.to_thread(_get, port, "/healthz") == (200, "ok\n")
        gid = f"h-{uuid.uuid4().hex[:6]}"
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(make_group(gid, 1, turns=1, output_tokens=8))
        await wait_for_verdicts(cfg, [gid])
        # the verdict is on the topic a moment before the worker counts it: poll the counter
        body = await eventually(
            metrics,
            accept=lambda body: 'prm_worker_verdicts_total{reason="",status="accepted"} 1.0' in body,
            timeout_s=10,
            what="the accepted verdict counted",
        )
        assert "prm_worker_scoring_seconds_count 1.0" in body
        # a discard's free text stays in the verdict; the label is its reason code
        dropped = f"d-{uuid.uuid4().hex[:6]}"
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.discard_group(dropped, "environment crashed before turn 3")
        (discarded,) = [v for v in await wait_for_verdicts(cfg, [dropped]) if v.group_id == dropped]
        assert (discarded.reason_code, discarded.reason) == ("discarded", "environment crashed before turn 3")
        body = await eventually(
            metrics,
            accept=lambda body: 'prm_worker_verdicts_total{reason="discarded",status="discarded"} 1.0' in body,
            timeout_s=10,
            what="the discarded verdict counted",
        )
        assert "environment" not in body
        assert (await asyncio.to_thread(_get, port, "/nope"))[0] == 404
        stop.set()
        await eventually(
            lambda: asyncio.to_thread(_get, port, "/readyz"),
            accept=lambda got: got[0] != 200,
            timeout_s=20,
            what="not ready once stopping",
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_hanging_scorer_times_out_and_rejects_the_group(pipeline_config) -> None:
    cfg = with_scorers(pipeline_config, PRMScorerConfig("tests.scorers.SlowScorer"), scorer_timeout_s=0.5)
    await ensure_topics(cfg.kafka, cfg.topics)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(cfg, worker_id="w-timeout").run(stop))
    try:
        gid = f"hang-{uuid.uuid4().hex[:6]}"
        hang = make_session(
            trajectory_id=f"{gid}-1", session_id=f"{gid}-HANG", group_id=gid, group_size=2, turns=1, output_tokens=4
        )
        ok = make_session(
            trajectory_id=f"{gid}-2", session_id=f"{gid}-fine", group_id=gid, group_size=2, turns=1, output_tokens=4
        )
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many([hang, ok])
        (verdict,) = await wait_for_verdicts(cfg, [gid], timeout_s=30)
        assert verdict.status == "rejected" and verdict.reason_code == "scorer_timeout", verdict.reason
        assert verdict.reason.startswith(f"scorer_timeout: member '{gid}-1' (session '{gid}-HANG'): "), verdict.reason
        assert {s.trajectory_id: s.status for s in verdict.sessions} == {f"{gid}-1": "failed", f"{gid}-2": "scored"}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_scorer_outside_the_allow_list_is_refused_at_start(pipeline_config) -> None:
    cfg = with_scorers(
        pipeline_config, PRMScorerConfig("tests.scorers.SlowScorer"), allowed_scorer_modules=["scoring_workers.scorers"]
    )
    with pytest.raises(ConfigError, match="'tests.scorers.SlowScorer' is refused"):
        await Worker(cfg).run(asyncio.Event())


async def test_dead_letter_payloads_are_size_capped(pipeline_config) -> None:
    from infra.kafka import make_producer
    from infra.schema import dead_letter_from_record
    from tests.integration.harness import read_topic

    cfg = with_scorers(
        pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer"), dead_letter_max_bytes=1024
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(
            cfg.topics.trajectories,
            b"\xc1" * 5000,
            key=b"big-junk",
            headers=[("prm-schema-version", b"1"), ("prm-kind", b"ready")],
        )
    finally:
        await producer.stop()
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(cfg, worker_id="w-dlq").run(stop))
    try:
        records = await eventually(
            lambda: read_topic(cfg, cfg.topics.dead_letters), timeout_s=30, interval_s=0, what="a dead letter"
        )
        (letter,) = [dead_letter_from_record(r.value, r.headers) for r in records]
        assert len(letter.payload) == 1024 and letter.payload == b"\xc1" * 1024
        assert letter.original_size == 5000 and letter.error_class == "InvalidMessage"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_discard_lists_the_members_consumed_before_it(pipeline_config) -> None:
    """examples/trajectories.jsonl as published: ``example-dropped``'s member comes before its
    discard in the same partition, so the discarded verdict lists it (status ``discarded``)."""
    from pathlib import Path

    from tests.integration.harness import running_worker

    cfg = pipeline_config
    examples = Path(__file__).resolve().parents[2] / "examples" / "trajectories.jsonl"
    async with running_worker(cfg, "w-discard"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_jsonl(examples)
        verdicts = {v.group_id: v for v in await wait_for_verdicts(cfg, ["example-math", "example-dropped"])}
    dropped = verdicts["example-dropped"]
    assert dropped.status == "discarded"
    assert dropped.reason == "environment crashed before the second session finished"
    assert dropped.group_size == 2  # the member's group_size, not the "no member seen" 0
    assert [(s.trajectory_id, s.status) for s in dropped.sessions] == [("example-dropped-t1", "discarded")]
    assert verdicts["example-math"].status == "accepted"


async def test_discard_waits_for_an_earlier_member_still_scoring(pipeline_config) -> None:
    cfg = with_scorers(pipeline_config, PRMScorerConfig("tests.scorers.SlowScorer", kwargs={"delay_s": 0.5}))
    from tests.integration.harness import running_worker

    gid = f"disc-slow-{uuid.uuid4().hex[:6]}"
    (member,) = make_group(gid, 2, turns=1, output_tokens=4)[:1]
    async with running_worker(cfg, "w-discard-slow"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many([member])
            await pub.discard_group(gid, "dropped while scoring")
        (verdict,) = await wait_for_verdicts(cfg, [gid], timeout_s=30)
    assert (verdict.status, verdict.reason) == ("discarded", "dropped while scoring")
    (session,) = verdict.sessions
    assert (session.trajectory_id, session.status, session.stats) == (member.trajectory_id, "discarded", {})


async def test_a_failed_member_rejects_its_group_without_waiting_for_the_deadline(pipeline_config) -> None:
    """group_timeout_s is 600 s and a third member never comes: the failure alone decides.
    The member consumed before the failure (still scoring, slow) is listed with its stats."""
    from tests.integration.harness import running_worker

    cfg = with_scorers(
        pipeline_config,
        PRMScorerConfig("tests.scorers.FailOnMarkerScorer"),
        PRMScorerConfig("tests.scorers.SlowScorer", kwargs={"delay_s": 0.5}),
        group_timeout_s=600,
    )
    gid = f"fail-fast-{uuid.uuid4().hex[:6]}"
    ok = make_session(
        trajectory_id=f"{gid}-ok", session_id=f"{gid}-fine", group_id=gid, group_size=3, turns=1, output_tokens=4
    )
    bad = make_session(
        trajectory_id=f"{gid}-bad", session_id=f"{gid}-FAIL", group_id=gid, group_size=3, turns=1, output_tokens=4
    )
    async with running_worker(cfg, "w-fail-fast"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many([ok, bad])
        (verdict,) = await wait_for_verdicts(cfg, [gid], timeout_s=30)  # far under the 600 s deadline
    assert (verdict.status, verdict.reason_code) == ("rejected", "scorer_error"), verdict.reason
    assert verdict.reason.startswith(f"scorer_error: member '{gid}-bad' (session '{gid}-FAIL'): ")  # names the member
    by_traj = {s.trajectory_id: s for s in verdict.sessions}
    assert set(by_traj) == {f"{gid}-ok", f"{gid}-bad"}
    assert by_traj[f"{gid}-bad"].status == "failed" and by_traj[f"{gid}-bad"].stats == {}
    assert by_traj[f"{gid}-ok"].status == "scored"
    assert by_traj[f"{gid}-ok"].stats["rollout/prm_turn_reward/slow"] == 0.0  # scored members keep their stats


async def test_the_worker_says_which_scorers_run_and_warns_when_none_does(pipeline_config, caplog) -> None:
    """Before: a worker without --config accepted every group unscored and said nothing."""
    await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    stopped = asyncio.Event()
    stopped.set()  # start up (scorers, Redis, Kafka), then leave before consuming anything
    scored = with_scorers(
        pipeline_config,
        PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", weight=0.5, kwargs={"max_output_tokens": 64}),
    )
    with caplog.at_level(logging.INFO, logger="scoring_workers.worker"):
        await asyncio.wait_for(Worker(scored, worker_id="w-said").run(stopped), 60)
        await asyncio.wait_for(Worker(pipeline_config, worker_id="w-bare").run(stopped), 60)
    said = [r.getMessage() for r in caplog.records if "w-said" in r.getMessage()]
    assert (
        "worker w-said: scorer 'length_budget' (active): weight=0.5 version=1 "
        "class=scoring_workers.scorers.length_budget.LengthBudgetScorer"
    ) in said
    assert not any("NO SCORER" in m for m in said)
    (bare,) = [r for r in caplog.records if "w-bare" in r.getMessage() and "NO SCORER" in r.getMessage()]
    assert bare.levelno == logging.WARNING
    assert (
        "rollout.agent.prm.scorers is empty or absent (was the worker started without --config?)" in bare.getMessage()
    )
