"""Scenario 7 — a worker process SIGKILLed in the middle of streamed sessions.

Real ``prm-pipeline worker`` processes (:class:`~prm_pipeline.demo.processes.WorkerProcesses`),
the real broker and redis-server, the OpenClaw judge (a fake judge server), the length
budget and a trajectory scorer. Every kill is triggered by evidence in Redis (the turns
parked, the member parked), never by a sleep:

* killed between two turns of a session: the next worker continues the session from the
  turns parked in Redis, and the verdict equals the one the ``ready`` form of the same
  session gets (token rewards and token turns bit for bit);
* killed after it scored a member's ``end`` but before its group was decided (the other
  member ends after the kill): the worker that decides the group reads the member back
  from its ``turn`` records in the log, and the verdict carries its tokens — it is not
  rejected as ``tokens_unavailable``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import redis.asyncio as aioredis

from infra.schema import compact_turns, stream_session
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from producers.publisher import TrajectoryPublisher
from scoring_workers.ledger import GroupLedger, decode_parked
from scoring_workers.session_store import SessionStore
from tests.faults.common import report
from tests.integration.harness import read_topic, wait_for_verdicts, worker_processes
from tests.integration.test_streaming import config, scores, session, twin
from tests.polling import eventually

pytestmark = pytest.mark.integration

VERDICT_TIMEOUT_S = 120  # a killed worker's partitions move once the broker expires its session


@pytest.fixture(scope="module")
def judge():
    with FakeJudgeServer() as server:
        yield server


async def _parked_turns(cfg, group_id: str, trajectory_id: str, accept: Callable[[int], bool], what: str) -> None:
    """Wait until the number of the session's turns parked in Redis is accepted."""
    client = aioredis.from_url(cfg.redis.url)
    store = SessionStore(client, cfg.redis, idle_s=cfg.worker.session_idle_s, max_turns=cfg.worker.session_max_turns)
    try:
        await eventually(
            lambda: store.load(group_id, trajectory_id),
            accept=lambda parked: accept(len(parked.turns)),
            timeout_s=60,
            what=what,
        )
    finally:
        await client.aclose()


async def _parked_member(cfg, group_id: str, trajectory_id: str):
    """Wait until the member is parked in the group's ledger hash; return it."""
    ledger = GroupLedger.from_config(cfg.redis)
    try:
        blobs = await eventually(
            lambda: ledger.view.parked_blobs(group_id),
            accept=lambda members: trajectory_id in members,
            timeout_s=60,
            what=f"member {trajectory_id} parked",
        )
    finally:
        await ledger.aclose()
    return decode_parked(blobs[trajectory_id])


async def _publish(pub: TrajectoryPublisher, *turns_or_ends: msgspec.Struct) -> None:
    for message in turns_or_ends:
        await pub.publish(message)
    await pub.flush()


async def test_a_worker_sigkilled_between_two_turns_loses_nothing(kafka_bootstrap, redis_url, judge, tmp_path) -> None:
    cfg = config(kafka_bootstrap, redis_url, judge)
    rng = np.random.default_rng(43)
    traj = session("kill", "gkill", 1, rng, turns=7, branch=True)
    turns, end = stream_session(traj)
    assert len(turns) >= 6
    async with worker_processes(cfg, tmp_path, n=1) as procs:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await _publish(pub, *turns[:4])
            await _parked_turns(cfg, "gkill", "kill", lambda n: n >= 4, "4 turns parked (acknowledged)")
            killed = time.monotonic()
            procs.kill(0)  # between turn 4 and turn 5: its memory (and any judge call in flight) is gone
            procs.start(0)
            await _publish(pub, *turns[4:], end, twin(traj, "@ready"))
            verdicts = {
                v.group_id: v for v in await wait_for_verdicts(cfg, ["gkill", "gkill@ready"], VERDICT_TIMEOUT_S)
            }
            recovered_s = time.monotonic() - killed
    streamed, ready = verdicts["gkill"], verdicts["gkill@ready"]
    assert streamed.worker_id == "w0.2", streamed.worker_id  # the worker started after the kill
    assert ready.status == "accepted", ready.reason
    assert scores(streamed) == scores(ready)  # token rewards, turn results and token turns: bit for bit
    assert await read_topic(cfg, cfg.topics.dead_letters) == []
    report(
        "streamed session, SIGKILL between two turns",
        turns=len(turns),
        killed_after=4,
        verdict=streamed.status,
        kill_to_verdicts_s=round(recovered_s, 2),
    )


async def test_a_member_whose_worker_was_sigkilled_before_the_decision_keeps_its_tokens(
    kafka_bootstrap, redis_url, judge, tmp_path
) -> None:
    cfg = config(kafka_bootstrap, redis_url, judge)
    rng = np.random.default_rng(44)
    a = session("ka", "gk2", 2, rng, turns=6, branch=True)
    b = session("kb", "gk2", 2, rng, turns=4)
    a_turns, a_end = stream_session(a)
    b_turns, b_end = stream_session(b)
    async with worker_processes(cfg, tmp_path, n=1) as procs:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            # a's turns interleaved with b's first ones (one partition: the group's key), then a's end
            await _publish(pub, a_turns[0], b_turns[0], *a_turns[1:3], b_turns[1], *a_turns[3:], a_end)
            parked = await _parked_member(cfg, "gk2", "ka")
            await _parked_turns(cfg, "gk2", "kb", lambda n: n >= 2, "2 turns of kb parked")
            await _parked_turns(cfg, "gk2", "ka", lambda n: n == 0, "ka's turns gone from Redis once it is parked")
            assert parked.result.status == "scored" and parked.result.turns == []  # Redis holds no token turns
            assert parked.partition >= 0 and parked.offset >= 0  # parked at its first turn's record
            killed = time.monotonic()
            procs.kill(0)  # a's turns lived in that worker's memory only
            procs.start(0)
            await _publish(pub, *b_turns[2:], b_end, twin(a, "@ready"), twin(b, "@ready"))
            verdicts = {v.group_id: v for v in await wait_for_verdicts(cfg, ["gk2", "gk2@ready"], VERDICT_TIMEOUT_S)}
            recovered_s = time.monotonic() - killed
    streamed, ready = verdicts["gk2"], verdicts["gk2@ready"]
    assert streamed.worker_id == "w0.2", streamed.worker_id
    assert streamed.status == "accepted", streamed.reason  # not tokens_unavailable
    by_id = {s.trajectory_id: s for s in streamed.sessions}
    assert by_id["ka"].turns == compact_turns(a.interactions)  # read back from the log
    assert scores(streamed) == scores(ready)
    report(
        "streamed member, SIGKILL between its end and the decision",
        members=2,
        verdict=streamed.status,
        kill_to_verdicts_s=round(recovered_s, 2),
    )
