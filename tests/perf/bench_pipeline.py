"""End-to-end pipeline benchmark on the embedded stack (``prm-pipeline bench pipeline``).

In one run, on the same broker and machine:

(a) publish -> N worker processes (LengthBudgetScorer) -> verdicts, trajectories/s;
(b) raw aiokafka produce + consume of the same encoded bytes (the transport ceiling);
(c) the in-process ``PRMRunner`` on the same trajectories (the AReaL-style baseline);
then p50/p99 publish-to-verdict latency with the load paced at half of (a).

Ratios are the figures to quote; absolute rates on a shared 2-core box are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from infra.config import (
    ActorConfig,
    AgentConfig,
    KafkaConfig,
    PipelineConfig,
    PRMConfig,
    PRMScorerConfig,
    RedisConfig,
    RolloutConfig,
    TopicsConfig,
    WorkerConfig,
)
from infra.kafka import ensure_topics, make_consumer, make_producer
from infra.local import LocalStack
from infra.schema import ReadyTrajectory, encode
from prm_pipeline.observe import VerdictTail
from prm_pipeline.processes import WorkerProcesses, write_config
from producers.publisher import TrajectoryPublisher
from producers.synthetic import make_group


def _config(stack: LocalStack, name: str, concurrency: int, compression: str = "zstd") -> PipelineConfig:
    return PipelineConfig(
        rollout=RolloutConfig(agent=AgentConfig(prm=PRMConfig(scorers=[
            PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 384}),
        ]))),
        actor=ActorConfig(token_rewards_as_adv=True),
        kafka=KafkaConfig(bootstrap=stack.kafka_bootstrap, session_timeout_ms=2000, heartbeat_interval_ms=500,
                          linger_ms=5, max_message_bytes=8 * 1024 * 1024, compression=compression),
        redis=RedisConfig(url=stack.redis_url, key_prefix=f"bench:{name}", ttl_s=600),
        topics=TopicsConfig(trajectories=f"traj.{name}", verdicts=f"verd.{name}", dead_letters=f"dlq.{name}",
                            partitions=8),
        worker=WorkerConfig(group_id=f"workers.{name}", concurrency=concurrency, group_timeout_s=600),
    )


def _groups(n: int, size: int, turns: int, tokens: int, prefix: str) -> list[list[ReadyTrajectory]]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [make_group(f"{prefix}{g:05d}", size, rng=rng, turns=turns, output_tokens=(tokens // 2, tokens))
            for g in range(n)]


async def _raw_baseline(cfg: PipelineConfig, payloads: list[tuple[bytes, bytes, list]]) -> float:
    """Produce + consume the same records through the same broker; returns records/s."""
    topic = f"raw.{uuid.uuid4().hex[:8]}"
    await ensure_topics(cfg.kafka, cfg.topics, [topic])
    consumer = make_consumer(cfg.kafka, topic, group_id=f"raw-{topic}", fetch_max_wait_ms=10)
    await consumer.start()
    while not consumer.assignment():  # join the group before the clock starts
        await consumer.getmany(timeout_ms=100)
    producer = make_producer(cfg.kafka)
    await producer.start()
    t0 = time.perf_counter()

    async def produce() -> None:
        for key, value, headers in payloads:
            await producer.send(topic, value, key=key, headers=headers)
        await producer.flush()

    prod = asyncio.create_task(produce())
    got = 0
    while got < len(payloads):
        for records in (await consumer.getmany(timeout_ms=100)).values():
            got += len(records)
    elapsed = time.perf_counter() - t0
    await prod
    await producer.stop()
    await consumer.stop()
    return len(payloads) / elapsed


async def _runner_baseline(cfg: PipelineConfig, trajectories: list[ReadyTrajectory]) -> float:
    from scoring_workers.prm import PRMRunner

    runner = await PRMRunner.create(cfg.prm)
    try:
        for t in trajectories[:8]:
            await runner.run(t)
        t0 = time.perf_counter()
        for t in trajectories:
            await runner.run(t)
        return len(trajectories) / (time.perf_counter() - t0)
    finally:
        await runner.aclose()


async def _pipeline(cfg: PipelineConfig, groups: list[list[ReadyTrajectory]], n_workers: int, workdir: Path,
                    latency_groups: int) -> tuple[float, list[float], float]:
    procs = WorkerProcesses(write_config(cfg, workdir / "config.yaml"), workdir, n=n_workers)
    tail = VerdictTail(cfg, decode=False)  # the load generator must not compete for CPU
    procs.start()
    try:
        await tail.start()
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            warm = make_group(f"warmup-{uuid.uuid4().hex[:6]}", 1, turns=1, output_tokens=8)
            await pub.publish_many(warm)
            await pub.flush()
            await tail.wait_for({warm[0].group_id}, 60)  # workers joined and scoring

            # (a) peak: publish everything as fast as possible
            peak = groups[: len(groups) - latency_groups]
            t0 = time.perf_counter()
            for g in peak:
                await pub.publish_many(g)
            await pub.flush()
            await tail.wait_for({g[0].group_id for g in peak}, 600)
            done = max(tail.arrivals[g[0].group_id] for g in peak)
            rate = sum(len(g) for g in peak) / (done - t0)

            # latency at half the peak rate: pace whole groups
            paced = groups[len(groups) - latency_groups:]
            interval = len(paced[0]) / (rate / 2)
            sent_at: dict[str, float] = {}
            start = time.perf_counter()
            for i, g in enumerate(paced):
                delay = start + i * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing the load generator, not synchronisation
                await pub.publish_many(g)
                await pub.flush()
                sent_at[g[0].group_id] = time.perf_counter()
            await tail.wait_for(set(sent_at), 600)
            latencies = sorted(tail.arrivals[gid] - t for gid, t in sent_at.items())
        return rate, latencies, interval
    finally:
        await tail.stop()
        procs.stop()


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


async def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="prm-bench-") as tmp, LocalStack(Path(tmp) / "stack") as stack:
        name = uuid.uuid4().hex[:8]
        cfg = _config(stack, name, args.concurrency, args.compression)
        await ensure_topics(cfg.kafka, cfg.topics)
        groups = _groups(args.groups + args.latency_groups, args.group_size, args.turns, args.tokens, f"b{name}-")
        trajectories = [t for g in groups for t in g]
        payloads = []
        for t in trajectories[: args.groups * args.group_size]:
            value, headers = encode(t)
            payloads.append((t.group_id.encode(), value, headers))
        mean_kib = statistics.mean(len(v) for _, v, _ in payloads) / 1024
        print(f"workload: {args.groups} groups x {args.group_size} sessions, {args.turns} turns, "
              f"<= {args.tokens} output tokens/turn, {mean_kib:.0f} KiB/trajectory on the wire")
        raw = await _raw_baseline(cfg, payloads)
        inproc = await _runner_baseline(cfg, trajectories[: args.groups * args.group_size])
        work = Path(tmp) / "workers"
        work.mkdir()
        e2e, latencies, interval = await _pipeline(cfg, groups, args.workers, work, args.latency_groups)
    print()
    print(f"{'path':52} {'traj/s':>10} {'ratio':>8}")
    print(f"{f'(a) pipeline: publish -> {args.workers} workers -> verdict':52} {e2e:10.0f} {'1.00':>8}")
    print(f"{'(b) raw aiokafka produce+consume, same bytes':52} {raw:10.0f} {e2e / raw:8.2f}  (a)/(b)")
    print(f"{'(c) in-process PRMRunner, same trajectories':52} {inproc:10.0f} {e2e / inproc:8.2f}  (a)/(c)")
    print()
    print(f"latency at half peak ({len(latencies)} groups, one every {interval * 1e3:.0f} ms): "
          f"p50 {_pct(latencies, 0.5) * 1e3:.0f} ms, p99 {_pct(latencies, 0.99) * 1e3:.0f} ms, "
          f"max {latencies[-1] * 1e3:.0f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=150)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--latency-groups", type=int, default=60)
    p.add_argument("--compression", choices=["zstd", "lz4", "gzip", "none"], default="zstd")
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
