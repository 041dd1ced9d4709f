"""A Redis Cluster config may list several nodes: a worker starts while the first one is down.

Runs on the one-node valkey cluster of ``test_ledger.py``; the node listed first is a
port nobody listens on (a node that failed over, a pod being rescheduled).
"""

from __future__ import annotations

import uuid

import msgspec
import pytest

from infra.config import PRMScorerConfig, RedisConfig
from infra.local import free_port
from infra.redis import make_redis
from infra.startup import ServiceUnavailable, wait_for_services
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from tests.integration.harness import isolated_config, running_worker, wait_for_verdicts
from tests.integration.test_ledger import cluster_url as cluster_url  # the one-node Redis Cluster fixture

pytestmark = pytest.mark.integration


async def test_a_worker_starts_on_a_cluster_whose_first_listed_node_is_down(
    cluster_url,
    kafka_bootstrap,
    redis_url,
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    name = f"nodes-{uuid.uuid4().hex[:8]}"
    base = isolated_config(
        name,
        kafka_bootstrap,
        redis_url,
        group_timeout_s=60,
        scorers=[PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer")],
    )
    cluster = RedisConfig(
        url=f"{dead},{cluster_url}", cluster=True, key_prefix=f"t-{name}", ttl_s=60, startup_timeout_s=10
    )
    cfg = msgspec.structs.replace(base, redis=cluster)
    # the dead node alone: the start-up wait gives up (what a single-node redis.url did)
    alone = msgspec.structs.replace(cfg, redis=msgspec.structs.replace(cluster, url=dead, startup_timeout_s=1))
    with pytest.raises(ServiceUnavailable, match="cannot reach Redis"):
        await wait_for_services(alone, ["redis"])
    await wait_for_services(cfg, ["redis"])  # the CLI's start-up gate: the live node answers
    for _ in range(8):  # the client tries its nodes in random order: some of these start with the dead one
        client = make_redis(cluster)
        try:
            assert await client.ping()
        finally:
            await client.aclose()
    gid = f"g-{uuid.uuid4().hex[:6]}"
    async with running_worker(cfg, "w-nodes"):  # and the worker runs its ledger on the cluster
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(make_group(gid, 2))
        (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=30) if v.group_id == gid]
    assert verdict.status == "accepted", verdict.reason
