"""Scenario 4 — a scorer that never returns, under load, with two worker processes.

``tests.scorers.SlowScorer`` hangs forever on conversations mentioning ``HANG``. Every
fourth group has one such member among ordinary ones; all groups are published at once.
Each hung member must time out after ``worker.scorer_timeout_s``, its group must be
rejected with reason ``scorer_timeout`` (the hung member ``failed`` without stats, its
peers ``scored``), every other group accepted — and nothing lost or decided twice, while
the hung members never stall the rest (slow scoring must not block the poll loop).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import numpy as np
import pytest

from infra.config import PRMScorerConfig
from infra.kafka import ensure_topics
from prm_pipeline.demo.synthetic import make_session
from producers.publisher import TrajectoryPublisher
from tests.faults.common import (
    FaultWorkers,
    check_verdicts,
    fault_config,
    log_dir,
    reason_code,
    report,
)
from tests.integration.harness import read_topic, wait_for_verdicts, write_config

pytestmark = pytest.mark.integration

N_GROUPS, GROUP_SIZE, HANG_EVERY = 100, 3, 4
SCORER_TIMEOUT_S = 1.0


async def test_hanging_scorer_times_out_under_load(kafka_bootstrap, redis_url, tmp_path) -> None:
    name = f"hang-{uuid.uuid4().hex[:8]}"
    cfg = fault_config(
        name,
        kafka_bootstrap,
        redis_url,
        concurrency=32,
        scorer_timeout_s=SCORER_TIMEOUT_S,
        scorers=[
            PRMScorerConfig("tests.scorers.SlowScorer", kwargs={"delay_s": 0.002, "hang_marker": "HANG"}),
            PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24}),
        ],
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    rng = np.random.default_rng(41)
    messages, hung = [], {}
    for g in range(N_GROUPS):
        gid = f"{name}-g{g:04d}"
        bad = int(rng.integers(0, GROUP_SIZE)) if g % HANG_EVERY == 0 else -1
        for i in range(GROUP_SIZE):
            sid = f"{gid}-s{i}" + ("-HANG" if i == bad else "")
            messages.append(
                make_session(
                    trajectory_id=f"{gid}-t{i}",
                    session_id=sid,
                    group_id=gid,
                    group_size=GROUP_SIZE,
                    turns=2,
                    output_tokens=(8, 32),
                    rng=rng,
                )
            )
            if i == bad:
                hung[gid] = f"{gid}-t{i}"
    expected = {m.group_id for m in messages}
    procs = FaultWorkers(write_config(cfg, tmp_path / "config.yaml"), log_dir(tmp_path), n=2)
    procs.start()
    try:
        t0 = time.monotonic()
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(messages)
        await wait_for_verdicts(cfg, expected, timeout_s=120)
        elapsed = time.monotonic() - t0
    finally:
        procs.stop()
    records = await read_topic(cfg, cfg.topics.verdicts)
    check = check_verdicts(records, expected)
    open_s = {g: v.timings.get("group_open_s", 0.0) for g, v in check.verdicts.items()}
    timed_out = procs.count_log(r"scoring failed: scorer_timeout")
    report(
        "4. hanging scorer under load (2 workers)",
        trajectories=len(messages),
        groups=len(expected),
        hung_members=len(hung),
        scorer_timeout_s=SCORER_TIMEOUT_S,
        member_timeouts_logged=timed_out,
        lost=len(check.missing),
        verdict_records=check.records,
        duplicates_before_dedupe=check.duplicates,
        conflicting=len(check.conflicting),
        statuses=dict(check.statuses),
        reasons=dict(Counter(reason_code(v) or "-" for v in check.verdicts.values())),
        max_group_open_s_hung=round(max(open_s[g] for g in hung), 2),
        max_group_open_s_other=round(max(open_s[g] for g in expected - hung.keys()), 2),
        all_verdicts_s=round(elapsed, 1),
        final_sigterm_exits=procs.final_exits(),
    )
    check.assert_exactly_once(procs.logs())
    for gid, verdict in check.verdicts.items():
        statuses = {s.trajectory_id: s.status for s in verdict.sessions}
        if gid in hung:
            assert (verdict.status, reason_code(verdict)) == ("rejected", "scorer_timeout"), verdict.reason
            assert statuses == {t: ("failed" if t == hung[gid] else "scored") for t in statuses}, statuses
            failed = next(s for s in verdict.sessions if s.status == "failed")
            assert failed.error.startswith("scorer_timeout") and not failed.stats and not failed.turn_results
            assert len(statuses) == GROUP_SIZE
        else:
            assert verdict.status == "accepted", (gid, verdict.reason)
    assert timed_out == len(hung), f"{timed_out} timeouts logged for {len(hung)} hung members"
    assert all(code == 0 for code, _ in procs.final_exits()), procs.logs()
