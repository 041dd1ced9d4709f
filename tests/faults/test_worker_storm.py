"""Scenario 1 — three workers, repeated SIGKILLs and a rebalance storm while load flows.

Workers are SIGKILLed, SIGTERMed (graceful drain overlapping the next start) and started
in quick succession, sometimes several at once, ending with all three SIGKILLed together.
Every step is triggered by progress (groups with a verdict), and load keeps flowing in
paced waves throughout. Afterwards the trainer's dedupe on ``(group_id, verdict_version)``
must leave exactly one verdict per group, all accepted, none missing; every SIGTERMed
worker that had started polling must have exited 0 (its drain and final commit worked
mid-storm).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from infra.config import PRMScorerConfig, WorkerConfig
from infra.kafka import ensure_topics
from prm_pipeline.demo.synthetic import workload
from tests.faults.common import (
    FaultWorkers,
    PacedLoad,
    VerdictTail,
    check_verdicts,
    fault_config,
    log_dir,
    report,
)
from tests.integration.harness import read_topic, write_config
from tests.polling import eventually, poll_until

pytestmark = pytest.mark.integration

REPUBLISH_GRACE_S = WorkerConfig().republish_grace_s  # the default worker.republish_grace_s

N_WORKERS, GROUP_SIZE = 3, 3
MAX_GROUPS = 2400  # the pool; load is published only while the storm lasts, at most
MAX_GROUPS_PER_S = 20  # this fast (the pool then lasts 2 minutes whatever the machine)
GROUP_TIMEOUT_S = 25

# (groups with a new verdict since the previous step, wait until every slot polls first,
# actions). "kill" = SIGKILL, "term" = SIGTERM without waiting for the exit (the old
# process drains while the next one joins), "start" = a new process in that slot.
STORM: list[tuple[int, bool, list[tuple[str, int]]]] = [
    (8, True, [("kill", 0), ("start", 0)]),
    (8, False, [("term", 1), ("start", 1)]),  # while slot 0 is still starting
    (8, True, [("kill", 2), ("term", 0), ("start", 2), ("start", 0)]),
    (8, False, [("term", 2)]),  # slot 2 left empty for a while
    (8, True, [("kill", 1), ("start", 1), ("start", 2)]),
    (8, False, [("term", 0), ("kill", 1), ("start", 0), ("start", 1)]),
    (8, True, [("kill", 0), ("kill", 1), ("kill", 2), ("start", 0), ("start", 1), ("start", 2)]),
    (8, True, [("term", 1), ("start", 1)]),
]


async def test_sigkill_and_rebalance_storm_with_three_workers(kafka_bootstrap, redis_url, tmp_path) -> None:
    name = f"storm-{uuid.uuid4().hex[:8]}"
    cfg = fault_config(
        name,
        kafka_bootstrap,
        redis_url,
        partitions=6,
        concurrency=16,
        group_timeout_s=GROUP_TIMEOUT_S,
        scorers=[
            PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24}),
        ],
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    procs = FaultWorkers(write_config(cfg, tmp_path / "config.yaml"), log_dir(tmp_path), n=N_WORKERS)
    messages = list(workload(MAX_GROUPS, GROUP_SIZE, seed=11, prefix=f"{name}-g", turns=2, output_tokens=(8, 32)))
    procs.start()
    t0, t0_wall = time.monotonic(), time.time()
    events: list[dict[str, object]] = []
    try:
        async with VerdictTail(cfg) as tail:
            storm_over = asyncio.Event()
            load = PacedLoad(
                cfg, messages, tail, wave=15, max_in_flight=45, enough=storm_over, max_groups_per_s=MAX_GROUPS_PER_S
            )
            publisher = asyncio.create_task(load.run())
            try:
                for step, (new_groups, wait_ready, actions) in enumerate(STORM):
                    ready = True
                    if wait_ready:
                        # A deadline, not an assertion: progress (below) is what must hold.
                        ready, _, _ = await poll_until(procs.all_polling, timeout_s=30)
                    target = len(tail.groups) + new_groups
                    try:
                        await eventually(
                            lambda target=target: len(tail.groups) >= target or publisher.done(),
                            timeout_s=120,
                            what=f"step {step}: {new_groups} more groups decided",
                        )
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}\nsteps so far: {events}\n{procs.diagnosis()}") from None
                    if publisher.done():
                        publisher.result()  # raises what went wrong
                        raise AssertionError(f"the pool of {MAX_GROUPS} groups ran out before step {step}")
                    in_flight = load.in_flight_messages()
                    for action, slot in actions:
                        {"kill": procs.kill, "term": procs.terminate, "start": procs.start}[action](slot)
                    events.append(
                        {
                            "step": step,
                            "actions": " ".join(f"{a}{i}" for a, i in actions),
                            "groups_done": len(tail.groups),
                            "all_polling_before": ready,
                            "in_flight_msgs": in_flight,
                            "t": time.time(),
                        }
                    )
                expected = await load.finish(publisher, tail)
            finally:
                if not publisher.done():
                    publisher.cancel()
            end, end_wall = time.monotonic(), time.time()
            for e in events:  # the first verdict produced after the step: recovery
                nxt = tail.first_created_after(e["t"])  # type: ignore[arg-type]
                e["next_verdict_s"] = round(nxt, 2) if nxt is not None else None
            max_stall = tail.max_gap(t0_wall, end_wall)
    finally:
        procs.stop()
    elapsed = end - t0
    graceful = procs.graceful_exits()
    records = await read_topic(cfg, cfg.topics.verdicts)
    check = check_verdicts(records, expected)
    report(
        "1. worker SIGKILL + rebalance storm (3 workers)",
        trajectories=load.trajectories(),
        groups=len(expected),
        sigkills=procs.events["sigkill"],
        sigterms=procs.events["sigterm"],
        starts=procs.events["start"],
        max_in_flight_at_fault=max(e["in_flight_msgs"] for e in events),  # type: ignore[type-var]
        lost=len(check.missing),
        verdict_records=check.records,
        duplicates_before_dedupe=check.duplicates,
        conflicting=len(check.conflicting),
        statuses=dict(check.statuses),
        longest_gap_without_verdict_s=round(max_stall, 2),
        max_decision_to_publish_s=round(max(check.publish_lag_s.values()), 2),
        verdicts_after_republish_grace=len(check.late(REPUBLISH_GRACE_S + 2)),
        elapsed_s=round(elapsed, 1),
        storm_sigterm_exits=graceful,
        final_sigterm_exits=procs.final_exits(),
        events=[{k: v for k, v in e.items() if k != "t"} for e in events],
    )
    # Nobody stopped these: a worker that died by itself (a rebalance crash) is a failure,
    # even though the next step restarted its slot and the pool kept up.
    assert procs.crashed == [], f"workers died by themselves: {procs.crashed}\n{procs.logs()}"
    check.assert_exactly_once(procs.logs())
    assert dict(check.statuses) == {"accepted": len(expected)}, check.statuses
    assert len(events) == len(STORM)
    # A worker SIGTERMed before it polled (still importing, or waiting for its first
    # assignment) held no work and may end otherwise; every worker that polled must drain
    # and exit 0.
    exits = graceful + procs.final_exits()
    assert all(code == 0 or not polled for code, polled in exits), (
        f"a SIGTERMed worker did not drain cleanly: {exits}\n{procs.logs()}"
    )
