"""Crash safety: SIGKILL a worker repeatedly while ~2,000 trajectories in 500 groups flow.

Afterwards every group must have exactly one distinct verdict after the trainer's
dedupe on ``(group_id, verdict_version)``, and none may be missing. Kills are triggered
by progress (verdict counts), not by timers.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka.structs import TopicPartition

from infra.aiokafka_internals import refresh_metadata
from infra.config import (
    PipelineConfig,
    PRMScorerConfig,
)
from infra.kafka import ensure_topics, make_consumer
from infra.schema import decode_verdict
from prm_pipeline.demo.synthetic import workload
from producers.publisher import TrajectoryPublisher
from tests.integration.harness import WorkerProcesses, isolated_config, read_topic, write_config
from tests.polling import eventually, poll_until

pytestmark = pytest.mark.integration

N_GROUPS, GROUP_SIZE = 500, 4
KILL_AT = (0.15, 0.35, 0.55, 0.75)  # fractions of groups with a verdict


async def _tail_groups(cfg: PipelineConfig, seen: set[str], stop: asyncio.Event) -> None:
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    try:

        async def partitions() -> set[int] | None:
            await refresh_metadata(consumer)
            return consumer.partitions_for_topic(cfg.topics.verdicts)

        parts = await eventually(partitions, timeout_s=30, interval_s=0, what="the verdicts topic's partitions")
        consumer.assign([TopicPartition(cfg.topics.verdicts, p) for p in parts])
        await consumer.seek_to_beginning()
        while not stop.is_set():
            for records in (await consumer.getmany(timeout_ms=100)).values():
                seen.update(r.key.decode() for r in records)
    finally:
        await consumer.stop()


async def test_sigkill_during_load_loses_and_duplicates_nothing(kafka_bootstrap, redis_url, tmp_path) -> None:
    name = f"crash-{uuid.uuid4().hex[:8]}"
    cfg = isolated_config(
        name,
        kafka_bootstrap,
        redis_url,
        kafka={"linger_ms": 2},
        concurrency=32,
        group_timeout_s=120,
        scorers=[PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 24})],
    )
    await ensure_topics(cfg.kafka, cfg.topics)
    procs = WorkerProcesses(write_config(cfg, tmp_path / "config.yaml"), tmp_path, n=2)
    procs.start()
    messages = list(workload(N_GROUPS, GROUP_SIZE, seed=7, prefix=f"{name}-g", turns=2, output_tokens=(8, 40)))
    expected = {m.group_id for m in messages}
    seen: set[str] = set()
    stop_tail = asyncio.Event()
    tail = asyncio.create_task(_tail_groups(cfg, seen, stop_tail))
    kills = 0
    t0 = time.monotonic()
    try:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            for i in range(0, len(messages), 100):  # publish in waves while workers are dying
                await pub.publish_many(messages[i : i + 100])
                await pub.flush()
                await asyncio.sleep(0)  # let the tail task run between waves

        def all_seen() -> bool:  # the progress check, which also kills at the planned points
            nonlocal kills
            if len(seen & expected) >= len(expected):
                return True
            if kills < len(KILL_AT) and len(seen & expected) >= KILL_AT[kills] * len(expected):
                procs.kill(kills % 2)  # alternate victims; restart at once
                procs.start(kills % 2)
                kills += 1
            return False

        await poll_until(all_seen, timeout_s=180)
        elapsed = time.monotonic() - t0
    finally:
        stop_tail.set()
        await tail
        codes = procs.stop()
    assert kills == len(KILL_AT), f"only {kills} kills happened\n{procs.logs()}"
    assert procs.crashed == [], f"workers died by themselves: {procs.crashed}\n{procs.logs()}"
    missing = expected - seen
    assert not missing, f"{len(missing)} groups without verdict, e.g. {sorted(missing)[:5]}\n{procs.logs()}"

    records = await read_topic(cfg, cfg.topics.verdicts)
    verdicts = [decode_verdict(r.value, r.headers) for r in records]
    by_key: dict[tuple[str, int], set[bytes]] = {}
    for record, verdict in zip(records, verdicts):
        by_key.setdefault((verdict.group_id, verdict.verdict_version), set()).add(record.value)
    groups = {g for g, _ in by_key}
    assert groups == expected
    assert len(by_key) == len(expected), "a group has two verdict versions"
    conflicting = [k for k, values in by_key.items() if len(values) > 1]
    assert not conflicting, f"redelivered verdicts differ for {conflicting[:5]}"
    statuses = {v.status for v in verdicts}
    n_discard = sum(1 for m in messages if m.__class__.__name__ == "DiscardGroup")
    assert statuses == {"accepted"} and n_discard == 0
    duplicates = len(records) - len(expected)
    print(
        f"\ncrash test: {len(messages)} trajectories, {len(expected)} groups, {kills} SIGKILLs, "
        f"{elapsed:.1f}s; verdict records {len(records)} (duplicates before dedupe: {duplicates}), "
        f"lost 0; exit codes {codes}"
    )
