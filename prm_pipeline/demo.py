"""``make demo``: the main job on the embedded stack, printing what it did.

Foundation stage: start the embedded broker and Redis, create the topics, publish a
few synthetic trajectories, read them back through a consumer group, decode them and
round-trip a key through Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import msgspec

from infra.config import PipelineConfig, load_config
from infra.kafka import ensure_topics, make_consumer, make_producer
from infra.local import LocalStack
from infra.redis import make_redis
from infra.schema import ReadyTrajectory, decode_message, encode
from producers.synthetic import workload


async def _round_trip(cfg: PipelineConfig, n_groups: int) -> None:
    created = await ensure_topics(cfg.kafka, cfg.topics)
    print(f"topics: {created}")
    messages = list(workload(n_groups, group_size=2, turns=3, output_tokens=(16, 64)))
    producer = make_producer(cfg.kafka)
    await producer.start()
    t0 = time.perf_counter()
    try:
        for msg in messages:
            value, headers = encode(msg)
            await producer.send(cfg.topics.trajectories, value, key=msg.group_id.encode(), headers=headers)
        await producer.flush()
    finally:
        await producer.stop()
    print(f"published {len(messages)} trajectories in {1e3 * (time.perf_counter() - t0):.1f} ms")

    consumer = make_consumer(cfg.kafka, cfg.topics.trajectories, group_id="prm-demo")
    await consumer.start()
    seen: list[ReadyTrajectory] = []
    try:
        deadline = time.monotonic() + 30
        while len(seen) < len(messages) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                seen += [decode_message(r.value, r.headers) for r in records]
        await consumer.commit()
    finally:
        await consumer.stop()
    tokens = sum(i.model_response.output_len for t in seen for i in t.interactions)
    print(f"consumed {len(seen)} trajectories back ({tokens} output tokens) — equal: {sorted(m.trajectory_id for m in messages) == sorted(t.trajectory_id for t in seen)}")

    redis = make_redis(cfg.redis)
    try:
        await redis.set(f"{cfg.redis.key_prefix}:demo", msgspec.msgpack.encode(len(seen)), ex=60)
        back = msgspec.msgpack.decode(await redis.get(f"{cfg.redis.key_prefix}:demo"))
        print(f"redis round trip: stored {len(seen)}, read {back}")
    finally:
        await redis.aclose()


def run_demo(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    with tempfile.TemporaryDirectory(prefix="prm-demo-") as data_dir:
        with LocalStack(data_dir, broker_binary=cfg.local.broker_binary, redis_binary=cfg.local.redis_binary) as stack:
            print(f"embedded stack: kafka {stack.kafka_bootstrap}, redis {stack.redis_url}")
            cfg = msgspec.structs.replace(
                cfg,
                kafka=msgspec.structs.replace(cfg.kafka, bootstrap=stack.kafka_bootstrap),
                redis=msgspec.structs.replace(cfg.redis, url=stack.redis_url),
            )
            asyncio.run(_round_trip(cfg, args.groups or 4))
    return 0
