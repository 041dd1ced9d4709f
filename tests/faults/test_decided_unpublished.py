"""A decided group whose decider died before moving its re-publish index entry is
published within the re-publish grace, not at the group deadline.

Found by scenario 1 (SIGKILL storm; also reachable through a transient Redis error, see
docs/faults.md). ``GroupLedger.park`` decides the group in the PARK script and only then,
in a second round trip, moves the group's ``deadlines`` entry to ``now + grace``. A worker
killed between the two leaves the entry at the group deadline; the fix: any worker that
meets the group ``decided`` but unfinished nudges the entry to ``now + grace``
(``GroupLedger.nudge``), so the sweeper re-publishes the stored decision soon.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest

from infra.config import WorkerConfig
from infra.kafka import ensure_topics
from infra.schema import SessionResult
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from scoring_workers.ledger import GroupLedger
from scoring_workers.verdicts import encode_scorers
from scoring_workers.worker import Worker
from tests.faults.common import report
from tests.integration.harness import wait_for_verdicts

pytestmark = pytest.mark.integration

REPUBLISH_GRACE_S = WorkerConfig().republish_grace_s  # the default worker.republish_grace_s

GROUP_TIMEOUT_S = 30.0  # far beyond the grace: a late verdict would be obvious


async def test_decision_left_by_a_dead_worker_is_published_within_the_grace(pipeline_config) -> None:
    cfg = msgspec.structs.replace(
        pipeline_config, worker=msgspec.structs.replace(pipeline_config.worker, group_timeout_s=GROUP_TIMEOUT_S)
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    gid = f"dead-decider-{uuid.uuid4().hex[:6]}"
    members = make_group(gid, 2, turns=1, output_tokens=4)
    ledger = GroupLedger.from_config(cfg.redis)
    try:
        outcome = None
        for m in members:  # what the dead worker did: park both members (the second decides)
            outcome, decision = await ledger.park(
                SessionResult(
                    session_id=m.session_id,
                    trajectory_id=m.trajectory_id,
                    status="scored",
                    outcome_reward=m.outcome_reward,
                ),
                group_id=gid,
                group_size=2,
                group_timeout_s=GROUP_TIMEOUT_S,
                worker_id="dead-worker",
                scorers=encode_scorers([]),
            )
        assert decision is not None and decision.outcome == "decided_now", outcome
        # ... and died before the grace update: the index entry still says "group deadline"
        first_seen = decision.state.first_seen
        await ledger.redis.zadd(ledger.deadlines_key, {gid: first_seen + int(GROUP_TIMEOUT_S * 1000)}, xx=True)
    finally:
        await ledger.aclose()
    # its records were never committed, so a new worker gets them again
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.publish_many(members)
    stop = asyncio.Event()
    worker = asyncio.create_task(Worker(cfg, worker_id="w-new").run(stop))
    try:
        t0 = time.monotonic()
        (verdict,) = await wait_for_verdicts(cfg, [gid], timeout_s=REPUBLISH_GRACE_S + 15)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
    report(
        "decided-but-unpublished group",
        verdict=verdict.status,
        seconds_to_verdict=round(elapsed, 1),
        republish_grace_s=REPUBLISH_GRACE_S,
        group_timeout_s=GROUP_TIMEOUT_S,
    )
    assert verdict.status == "accepted" and len(verdict.sessions) == 2  # nothing lost
    assert elapsed < REPUBLISH_GRACE_S + 5, f"verdict after {elapsed:.1f}s, not within the re-publish grace"
