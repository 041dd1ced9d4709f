"""Scenario 3 — the Kafka-protocol broker restarts mid-run, with durable storage.

A dedicated tansu broker keeps its log in ``s3://tansu/`` on a loopback S3 (moto), so
topics, records and committed offsets survive a restart. Two worker processes and a
paced producer use it; the broker is restarted twice on the same port — gracefully
(SIGTERM) and by SIGKILL — each outage lasting until every worker has logged a
connection error. Producers and workers must reconnect on their own (the producer
re-publishes a wave that was not acknowledged; the ledger absorbs the duplicates).

Expected: no group lost, none with two distinct verdicts after the trainer's dedupe, all
accepted.
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
    outage,
    recovery,
    report,
)
from tests.integration.harness import read_topic, write_config
from tests.polling import eventually

pytestmark = pytest.mark.integration

REPUBLISH_GRACE_S = WorkerConfig().republish_grace_s  # the default worker.republish_grace_s

GROUP_SIZE, MAX_GROUPS = 3, 600
STEPS = [(30, "graceful restart (SIGTERM)"), (30, "crash restart (SIGKILL)")]
AFTER_LAST = 30
GROUP_TIMEOUT_S = 20  # the deadline path stays inside the test's time if it is ever taken
# What a worker logs when it loses the broker (aiokafka's own warnings, or our retries).
BROKER_ERRORS = (
    r"Unable (?:to )?connect|KafkaConnectionError|Connection (?:reset|refused|lost)|transient \w+|"
    r"[Cc]oordinator .*dead|Marking the coordinator dead|Failed fetch|Heartbeat failed|commit of .* failed"
)


async def test_broker_restart_with_durable_storage_loses_nothing(durable_broker, redis_url, tmp_path) -> None:
    broker = durable_broker
    name = f"broker-{uuid.uuid4().hex[:8]}"
    cfg = fault_config(
        name,
        f"127.0.0.1:{broker.port}",
        redis_url,
        concurrency=16,
        group_timeout_s=GROUP_TIMEOUT_S,
        kafka={"request_timeout_ms": 10_000},
        scorers=[
            PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24}),
        ],
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    procs = FaultWorkers(write_config(cfg, tmp_path / "config.yaml"), log_dir(tmp_path), n=2)
    messages = list(workload(MAX_GROUPS, GROUP_SIZE, seed=31, prefix=f"{name}-g", turns=2, output_tokens=(8, 32)))
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
                    crash = "SIGKILL" in fault
                    events.append(
                        await outage(
                            fault,
                            load=load,
                            client_errors=lambda: procs.count_current_logs(BROKER_ERRORS),
                            min_errors_each=3,
                            up=broker.start,
                            # tansu drains its connections for ~5 s on SIGTERM and exits 0
                            down=broker.kill if crash else lambda: broker.stop(timeout_s=20),
                        )
                    )
                target = len(tail.groups) + AFTER_LAST
                await eventually(
                    lambda target=target: len(tail.groups) >= target,
                    timeout_s=120,
                    what="progress after the last restart",
                )
                expected = await load.finish(publisher, tail)
            finally:
                if not publisher.done():
                    publisher.cancel()
            elapsed = time.monotonic() - t0
            faults = recovery(events, tail)
            tail_read_errors = tail.read_errors
    finally:
        procs.stop()
    records = await read_topic(cfg, cfg.topics.verdicts)
    check = check_verdicts(records, expected)
    report(
        "3. broker restart, tansu on s3:// (moto), 2 workers",
        trajectories=load.trajectories(),
        groups=len(expected),
        lost=len(check.missing),
        verdict_records=check.records,
        duplicates_before_dedupe=check.duplicates,
        conflicting=len(check.conflicting),
        statuses=dict(check.statuses),
        producer_waves_republished=load.publish_retries,
        tail_read_errors=tail_read_errors,
        worker_retries_logged=procs.transient_errors(),
        max_decision_to_publish_s=round(max(check.publish_lag_s.values()), 2),
        verdicts_after_republish_grace=len(check.late(REPUBLISH_GRACE_S + 2)),
        elapsed_s=round(elapsed, 1),
        faults=faults,
        final_sigterm_exits=procs.final_exits(),
    )
    check.assert_exactly_once(procs.logs())
    assert dict(check.statuses) == {"accepted": len(expected)}, check.statuses
    assert all(f["clients_noticed"] for f in faults), faults
    assert [f["exit_code"] for f in faults] == [0, -9], f"the graceful stop was not graceful: {faults}"
    assert all(code == 0 for code, _ in procs.final_exits()), procs.logs()
