"""What a Redis failover can do to a decision, and why the trainer still trains on one verdict.

Redis replicates asynchronously: a replica promoted by a failover may lack the writes that
parked, decided and finished a group. Its members, delivered again (a redelivery after
the crash, or still in flight), then make another worker decide the group a second time
and publish a second verdict (docs/architecture.md, "Guarantees"). This test builds exactly
that state on a real broker and Redis — the group's ledger keys lost after its verdict was
published, its members delivered again — and checks the guarantee that remains: both
verdicts carry the same ``(experiment_id, group_id, verdict_version)``, and the trainer's
consumer trains on the group once and counts the other as a duplicate.
"""

from __future__ import annotations

import time
import uuid

import pytest

from infra.redis import make_redis
from infra.schema import decode_verdict
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from shaper import VerdictConsumer
from tests.integration.harness import read_topic, running_worker, with_scorers
from tests.integration.test_fleet import LENGTH
from tests.integration.test_verdict_consumer import collect, drain_until, groups_of, trainer_config

pytestmark = pytest.mark.integration


async def _lose_the_ledger(cfg) -> int:  # type: ignore[no-untyped-def]
    """Delete every key under the test's prefix: what a promoted replica that missed them holds."""
    client = make_redis(cfg.redis)
    try:
        keys = [k async for k in client.scan_iter(match=f"{cfg.redis.key_prefix}*")]
        return int(await client.delete(*keys)) if keys else 0
    finally:
        await client.aclose()


async def test_a_group_decided_again_after_lost_ledger_writes_reaches_the_trainer_once(
    pipeline_config, unique_name
) -> None:
    cfg = trainer_config(with_scorers(pipeline_config, LENGTH), unique_name, batch_groups=1)
    gid = f"fo-{uuid.uuid4().hex[:6]}"
    members = make_group(gid, 2)

    def verdicts_of_group(records: list) -> list:  # type: ignore[type-arg]
        return [r for r in records if r.key == gid.encode()]

    async def verdicts(count: int) -> list:  # type: ignore[type-arg]
        records = await read_topic(
            cfg,
            cfg.topics.verdicts,
            until=time.monotonic() + 30,
            stop_when=lambda rs: len(verdicts_of_group(rs)) >= count,
        )
        found = [decode_verdict(r.value, r.headers) for r in verdicts_of_group(records)]
        assert len(found) == count, f"{len(found)} verdicts of {gid}, expected {count}"
        return found

    async with running_worker(cfg, "w-old-primary"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(members)
        await verdicts(1)
    assert await _lose_the_ledger(cfg) > 0  # at least the finished group's dedupe fingerprint
    async with running_worker(cfg, "w-new-primary"):
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(members)  # the members delivered again
        first, second = await verdicts(2)

    assert (first.worker_id, second.worker_id) == ("w-old-primary", "w-new-primary")  # decided twice
    assert first.status == second.status == "accepted"
    assert (first.experiment_id, first.group_id, first.verdict_version) == (
        second.experiment_id,
        second.group_id,
        second.verdict_version,
    )  # the trainer's dedupe key
    async with VerdictConsumer(cfg) as consumer:
        batches = await collect(consumer, 1)
        await drain_until(consumer, "verdicts/duplicate", 1)
    assert groups_of(batches) == [gid] and sum(b.num_groups for b in batches) == 1
