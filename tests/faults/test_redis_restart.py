"""Scenario 2 — the ledger's Redis restarts mid-run (AOF ``appendfsync everysec``).

A dedicated Redis (its own data dir, append-only file) serves two worker processes while
load flows through the session broker. It is restarted twice on the same port: once
gracefully (SIGTERM: the AOF is flushed) and once by SIGKILL (a crash; whatever reached the
AOF file survives). Each outage lasts until the workers have noticed it (their logged
transient errors grew). The scripts loaded with SCRIPT LOAD do not survive a restart, so
the ledger's NOSCRIPT reload path runs too.

Expected: no group lost, none with two distinct verdicts after the trainer's dedupe
(byte-identical re-publishes are fine), all accepted; the finished groups the ledger
remembered before each restart (fingerprints in its dedupe sets) are still there after it
(the AOF did its job).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from infra.config import PRMScorerConfig, RedisConfig, WorkerConfig
from infra.kafka import ensure_topics
from infra.redis import make_redis
from prm_pipeline.demo.synthetic import workload
from tests.faults.common import (
    FaultWorkers,
    PacedLoad,
    VerdictTail,
    check_verdicts,
    fault_config,
    log_dir,
    outage,
    recovery,
    report,
)
from tests.integration.harness import read_topic, write_config
from tests.polling import eventually

pytestmark = pytest.mark.integration

REPUBLISH_GRACE_S = WorkerConfig().republish_grace_s  # the default worker.republish_grace_s

GROUP_SIZE, MAX_GROUPS = 3, 600
STEPS = [(40, "graceful restart (SIGTERM)"), (40, "crash restart (SIGKILL)")]  # (new groups before, fault)
AFTER_LAST = 40  # groups that must complete after the last restart before the load stops
GROUP_TIMEOUT_S = 20  # the deadline path stays inside the test's time if it is ever taken


async def _noscript_errors(redis_cfg: RedisConfig) -> int:
    """NOSCRIPT replies since the server started: the ledger hitting an empty script cache."""
    client = make_redis(redis_cfg)
    try:
        return int((await client.info("errorstats")).get("errorstat_NOSCRIPT", {}).get("count", 0))
    finally:
        await client.aclose()


async def _tombstones(redis_cfg: RedisConfig) -> int:
    """Finished groups the ledger remembers: fingerprints in its dedupe sets."""
    client = make_redis(redis_cfg)
    try:
        return sum(
            [
                await client.scard(key)
                async for key in client.scan_iter(match=f"{redis_cfg.key_prefix}:done:*", count=1000)
            ]
        )
    finally:
        await client.aclose()


async def test_redis_restart_with_aof_loses_and_duplicates_nothing(kafka_bootstrap, persistent_redis, tmp_path) -> None:
    redis = persistent_redis
    name = f"redis-{uuid.uuid4().hex[:8]}"
    cfg = fault_config(
        name,
        kafka_bootstrap,
        f"redis://127.0.0.1:{redis.port}/0",
        concurrency=16,
        group_timeout_s=GROUP_TIMEOUT_S,
        scorers=[
            PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24}),
        ],
    )
    client = make_redis(cfg.redis)
    try:
        persistence = await client.info("persistence")
    finally:
        await client.aclose()
    assert persistence["aof_enabled"] == 1, persistence
    await ensure_topics(cfg.kafka, cfg.topics)
    procs = FaultWorkers(write_config(cfg, tmp_path / "config.yaml"), log_dir(tmp_path), n=2)
    messages = list(workload(MAX_GROUPS, GROUP_SIZE, seed=21, prefix=f"{name}-g", turns=2, output_tokens=(8, 32)))
    procs.start()
    t0 = time.monotonic()
    events: list[dict[str, object]] = []
    try:
        async with VerdictTail(cfg) as tail:
            enough = asyncio.Event()
            load = PacedLoad(cfg, messages, tail, wave=15, max_in_flight=45, enough=enough)
            publisher = asyncio.create_task(load.run())
            try:
                await eventually(procs.all_polling, timeout_s=60, what="both workers polling")
                for new_groups, fault in STEPS:
                    target = len(tail.groups) + new_groups
                    await eventually(
                        lambda target=target: len(tail.groups) >= target,
                        timeout_s=120,
                        what=f"{new_groups} groups before {fault}",
                    )
                    if events:  # the previous restart's NOSCRIPT replies (the counter resets with the server)
                        events[-1]["noscript_replies_after"] = await _noscript_errors(cfg.redis)
                    tombstones_before = await _tombstones(cfg.redis)
                    crash = "SIGKILL" in fault
                    event = await outage(
                        fault,
                        load=load,
                        client_errors=lambda: procs.count_current_logs(procs.TRANSIENT),
                        min_errors_each=3,
                        down=redis.kill if crash else redis.stop,
                        up=redis.start,
                    )
                    event["tombstones_before"] = tombstones_before
                    event["tombstones_after"] = await _tombstones(cfg.redis)
                    events.append(event)
                target = len(tail.groups) + AFTER_LAST
                await eventually(
                    lambda target=target: len(tail.groups) >= target,
                    timeout_s=120,
                    what="progress after the last restart",
                )
                events[-1]["noscript_replies_after"] = await _noscript_errors(cfg.redis)
                expected = await load.finish(publisher, tail)
            finally:
                if not publisher.done():
                    publisher.cancel()
            elapsed = time.monotonic() - t0
            faults = recovery(events, tail)
    finally:
        procs.stop()
    records = await read_topic(cfg, cfg.topics.verdicts)
    check = check_verdicts(records, expected)
    report(
        "2. Redis restart with AOF (appendfsync everysec), 2 workers",
        trajectories=load.trajectories(),
        groups=len(expected),
        lost=len(check.missing),
        verdict_records=check.records,
        duplicates_before_dedupe=check.duplicates,
        conflicting=len(check.conflicting),
        statuses=dict(check.statuses),
        transient_errors_retried=procs.transient_errors(),
        max_decision_to_publish_s=round(max(check.publish_lag_s.values()), 2),
        verdicts_after_republish_grace=len(check.late(REPUBLISH_GRACE_S + 2)),
        elapsed_s=round(elapsed, 1),
        faults=faults,
        final_sigterm_exits=procs.final_exits(),
    )
    check.assert_exactly_once(procs.logs())
    assert dict(check.statuses) == {"accepted": len(expected)}, check.statuses
    for f in faults:
        assert f["clients_noticed"], f"the workers never noticed the outage: {f}"
        assert f["exit_code"] == (-9 if "SIGKILL" in f["fault"] else 0), f
        assert f["tombstones_before"] > 0, f"no finished group to check before the restart: {f}"
        assert f["tombstones_after"] >= f["tombstones_before"], f"ledger state lost across the restart: {f}"
        assert f["noscript_replies_after"] >= 1, f"the script cache survived the restart? {f}"
    assert all(code == 0 for code, _ in procs.final_exits()), procs.logs()
