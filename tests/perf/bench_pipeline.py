"""End-to-end pipeline benchmark on the embedded stack (``prm-pipeline bench pipeline``).

In one run, on the same broker and machine:

(a) publish -> N worker processes (LengthBudgetScorer) -> verdicts, trajectories/s;
(b) raw aiokafka produce + consume of the same encoded bytes (the transport ceiling),
    interleaved with (a): ``--pairs`` rounds of (b) then (a) on fresh groups, reported
    as the median ratio (a)/(b) with its range — one run of each says nothing on a
    shared machine, where the transport itself varies by 2x from run to run;
(c) the in-process ``PRMRunner`` on the same trajectories (the AReaL-style baseline);
(d) the ledger's Redis calls alone for the same scored results (Redis cost without the
    contention of the whole pipeline on the same cores);
then p50/p99 publish-to-verdict latency with the load paced at 10% and at 50% of (a),
each with its breakdown by stage (from the stage timestamps every verdict carries), and
Redis CPU (``INFO commandstats``), bytes and calls per trajectory during (a).

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
from typing import Any

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
from infra.local import BROKERS, LocalStack
from infra.schema import GroupVerdict, ReadyTrajectory, decode_verdict, encode
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from prm_pipeline.demo.synthetic import make_group
from prm_pipeline.observe import VerdictTail
from producers.publisher import TrajectoryPublisher
from tests.perf.stack_load import workers_assigned


def _config(
    stack: LocalStack, name: str, concurrency: int, compression: str = "zstd", verdict_tokens: str = "inline"
) -> PipelineConfig:
    return PipelineConfig(
        rollout=RolloutConfig(
            agent=AgentConfig(
                prm=PRMConfig(
                    scorers=[
                        PRMScorerConfig(
                            "scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 384}
                        ),
                    ]
                )
            )
        ),
        actor=ActorConfig(token_rewards_as_adv=True),
        kafka=KafkaConfig(
            bootstrap=stack.kafka_bootstrap,
            **stack.client_settings,
            max_message_bytes=8 * 1024 * 1024,
            compression=compression,
        ),
        redis=RedisConfig(url=stack.redis_url, key_prefix=f"bench:{name}", ttl_s=600),
        topics=TopicsConfig(
            trajectories=f"traj.{name}",
            verdicts=f"verd.{name}",
            dead_letters=f"dlq.{name}",
            experiments=f"exp.{name}",
            partitions=8,
        ),
        worker=WorkerConfig(
            group_id=f"workers.{name}", concurrency=concurrency, group_timeout_s=600, verdict_tokens=verdict_tokens
        ),  # type: ignore[arg-type]
    )


def _groups(n: int, size: int, turns: int, tokens: int, prefix: str) -> list[list[ReadyTrajectory]]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [
        make_group(f"{prefix}{g:05d}", size, rng=rng, turns=turns, output_tokens=(tokens // 2, tokens))
        for g in range(n)
    ]


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


async def _ledger_alone(
    cfg: PipelineConfig,
    trajectories: list[ReadyTrajectory],
    n_groups: int = 1500,
    group_size: int = 4,
    concurrency: int = 32,
) -> dict[str, float]:
    """The worker's Redis calls alone (probe, park, finish per member; no Kafka, no workers)
    for ``n_groups`` groups of real scored results: Redis CPU per trajectory without the
    contention of the full pipeline on the same cores."""
    import msgspec

    from scoring_workers.ledger import GroupLedger
    from scoring_workers.prm import PRMRunner
    from scoring_workers.scoring import score_member

    runner = await PRMRunner.create(cfg.prm)
    try:
        scored = [await score_member(runner, t, timeout_s=None) for t in trajectories[:group_size]]
    finally:
        await runner.aclose()
    redis_cfg = msgspec.structs.replace(cfg.redis, key_prefix=cfg.redis.key_prefix + ":alone")
    ledger = GroupLedger.from_config(redis_cfg)
    meter = _RedisMeter(cfg.redis.url)
    sem = asyncio.Semaphore(concurrency)

    async def one(g: int) -> None:
        gid = f"alone-{g}"
        async with sem:
            await ledger.probe_many([(gid, f"{gid}-{i}") for i in range(group_size)])
            await asyncio.gather(
                *(
                    ledger.park(
                        msgspec.structs.replace(r, trajectory_id=f"{gid}-{i}"),
                        group_id=gid,
                        group_size=group_size,
                        group_timeout_s=600,
                        worker_id="bench",
                        scorers=b"\x90",
                        partition=0,
                        offset=i,
                    )
                    for i, r in enumerate(scored)
                )
            )
            await ledger.finish(gid)

    try:
        await ledger.probe_many([("warm", "up")])
        await meter.reset()
        await asyncio.gather(*(one(g) for g in range(n_groups)))
        got = await meter.read()
    finally:
        await ledger.aclose()
        await meter.aclose()
    n = n_groups * group_size
    return {
        "usec": got["usec"] / n,
        "cpu_us": got["cpu_s"] / n * 1e6,
        "in": got["in"] / n,
        "out": got["out"] / n,
        "scripts": got["scripts"] / n,
    }


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


class _RedisMeter:
    """Redis work between two points, from ``INFO commandstats`` / ``INFO stats``."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.Redis.from_url(url)

    async def _cpu(self) -> float:
        cpu = await self.client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    async def reset(self) -> None:
        await self.client.config_resetstat()
        self.cpu0 = await self._cpu()

    async def read(self) -> dict[str, Any]:
        """Commands the clients sent (script calls count once: commandstats also lists the
        commands a script runs, inside its own time) and the server's whole CPU."""
        cpu = await self._cpu() - self.cpu0
        stats = {k[len("cmdstat_") :]: v for k, v in (await self.client.info("commandstats")).items()}
        net = await self.client.info("stats")
        scripts = {k: v for k, v in stats.items() if k in ("evalsha", "eval", "fcall")}
        inner = {
            "hset",
            "hget",
            "hgetall",
            "hexists",
            "hlen",
            "exists",
            "del",
            "set",
            "sismember",
            "sadd",
            "hmget",
            "hdel",
            "hsetnx",
        }  # only ever run inside the ledger's scripts
        mine = {k: v for k, v in stats.items() if k not in ("info", "config|resetstat")}
        top = {k: v for k, v in mine.items() if k not in inner}
        return {
            "usec": sum(v["usec"] for v in top.values()),
            "cpu_s": cpu,
            "scripts": sum(v["calls"] for v in scripts.values()),
            "calls": sum(v["calls"] for v in top.values()),
            "all_calls": sum(v["calls"] for v in mine.values()),  # scripts' own commands too
            "in": net["total_net_input_bytes"],
            "out": net["total_net_output_bytes"],
            "by_command": {k: (v["calls"], v["usec"]) for k, v in top.items()},
        }

    async def aclose(self) -> None:
        await self.client.aclose()


STAGES = ("queue", "score", "park", "decide", "send", "deliver")


def _stages(verdict: GroupVerdict, published: float, record_ts: float, arrival_wall: float) -> dict[str, float] | None:
    """Seconds per stage for the member that completed the group (the last one parked):
    published (wall clock, when the bench's flush returned) -> consumed -> scored -> parked
    -> decided -> verdict record -> the bench's tail."""
    members = [m for m in verdict.sessions if getattr(m, "parked_at", 0.0)]
    if not members:
        return None  # verdicts of a worker without stage timestamps
    m = max(members, key=lambda x: x.parked_at)
    return {
        "queue": m.consumed_at - published,
        "score": m.scored_at - m.consumed_at,
        "park": m.parked_at - m.scored_at,
        "decide": verdict.decided_at - m.parked_at,
        "send": record_ts - verdict.decided_at,
        "deliver": arrival_wall - record_ts,
    }


async def _paced(
    pub: TrajectoryPublisher, tail: VerdictTail, groups: list[list[ReadyTrajectory]], rate: float
) -> dict[str, Any]:
    """Publish whole groups at ``rate`` trajectories/s; latency per group and its stage breakdown."""
    interval = len(groups[0]) / rate
    sent_at: dict[str, float] = {}
    published: dict[str, float] = {}
    start = time.perf_counter()
    for i, g in enumerate(groups):
        delay = start + i * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing the load generator, not synchronisation
        wall = time.time()
        await pub.publish_many(g)
        await pub.flush()
        sent_at[g[0].group_id] = time.perf_counter()
        published[g[0].group_id] = wall
    await tail.wait_for(set(sent_at), 600)
    latencies = sorted(tail.arrivals[gid] - t for gid, t in sent_at.items())
    stages: dict[str, list[float]] = {k: [] for k in STAGES}
    for gid in sent_at:
        record_ts, value, headers, wall = tail.raw[gid]
        got = _stages(decode_verdict(value, headers), published[gid], record_ts, wall)
        for k, v in (got or {}).items():
            stages[k].append(v)
    return {"interval": interval, "latencies": latencies, "stages": {k: sorted(v) for k, v in stages.items() if v}}


def _payloads(groups: list[list[ReadyTrajectory]]) -> list[tuple[bytes, bytes, list]]:
    out = []
    for g in groups:
        for t in g:
            value, headers = encode(t)
            out.append((t.group_id.encode(), value, headers))
    return out


async def _pipeline(
    cfg: PipelineConfig,
    rounds: list[list[list[ReadyTrajectory]]],
    n_workers: int,
    workdir: Path,
    latency: list[list[ReadyTrajectory]],
    redis_url: str,
) -> dict[str, Any]:
    """Workers up once; then per round the raw baseline (b) and the pipeline at peak (a)
    on that round's groups, back to back; then the paced latency runs."""
    procs = WorkerProcesses(write_config(cfg, workdir / "config.yaml"), workdir, n=n_workers)
    tail = _RawTail(cfg)  # keys + raw bytes: the load generator must not compete for CPU decoding
    meter = _RedisMeter(redis_url)
    procs.start()
    try:
        await workers_assigned(procs)  # the group formed before the first record (noida-db needs it)
        await tail.start()
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            warm = make_group(f"warmup-{uuid.uuid4().hex[:6]}", 1, turns=1, output_tokens=8)
            await pub.publish_many(warm)
            await pub.flush()
            await tail.wait_for({warm[0].group_id}, 60)  # workers joined and scoring

            pairs: list[tuple[float, float]] = []
            redis: dict[str, Any] = {}
            verdict_bytes = n_peak = 0
            for peak in rounds:
                raw = await _raw_baseline(cfg, _payloads(peak))  # (b), then at once (a) on the same bytes
                await meter.reset()
                t0 = time.perf_counter()
                for g in peak:
                    await pub.publish_many(g)
                await pub.flush()
                await tail.wait_for({g[0].group_id for g in peak}, 600)
                done = max(tail.arrivals[g[0].group_id] for g in peak)
                got = await meter.read()
                for k, v in got.items():  # Redis work summed over the rounds
                    if k == "by_command":
                        acc = redis.setdefault(k, {})
                        for c, (calls, usec) in v.items():
                            a = acc.get(c, (0, 0))
                            acc[c] = (a[0] + calls, a[1] + usec)
                    else:
                        redis[k] = redis.get(k, 0) + v
                n = sum(len(g) for g in peak)
                n_peak += n
                verdict_bytes += sum(len(tail.raw[g[0].group_id][1]) for g in peak)
                pairs.append((n / (done - t0), raw))
                print(
                    f"  round {len(pairs)}: pipeline {pairs[-1][0]:.0f}/s, raw {raw:.0f}/s, "
                    f"ratio {pairs[-1][0] / raw:.2f}",
                    flush=True,
                )
            rate = statistics.median(a for a, _ in pairs)
            n_lat = len(latency) // 2
            low = await _paced(pub, tail, latency[:n_lat], rate * 0.1)
            half = await _paced(pub, tail, latency[n_lat:], rate * 0.5)
        return {
            "pairs": pairs,
            "rate": rate,
            "redis": redis,
            "trajectories": n_peak,
            "low": low,
            "half": half,
            "verdict_bytes": verdict_bytes / n_peak,
        }
    finally:
        await tail.aclose()
        await meter.aclose()
        procs.stop()


class _RawTail(VerdictTail):
    """:class:`VerdictTail` that keeps each group's first verdict record undecoded (bytes,
    headers, producer timestamp, arrival wall time) for the stage breakdown."""

    def __init__(self, cfg: PipelineConfig) -> None:
        super().__init__(cfg, decode=False)
        self.raw: dict[str, tuple[float, bytes, Any, float]] = {}

    async def _run(self) -> None:
        while not self._stop.is_set():
            batch = await self.consumer.getmany(timeout_ms=50)
            now, wall = time.perf_counter(), time.time()
            for records in batch.values():
                for r in records:
                    self.records += 1
                    gid = r.key.decode()
                    if gid not in self.arrivals:
                        self.arrivals[gid] = now
                        self.raw[gid] = (r.timestamp / 1000, r.value, r.headers, wall)


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def _latency_lines(label: str, run: dict[str, Any]) -> list[str]:
    lat = run["latencies"]
    lines = [
        f"latency at {label} of peak ({len(lat)} groups, one every {run['interval'] * 1e3:.0f} ms): "
        f"p50 {_pct(lat, 0.5) * 1e3:.0f} ms, p99 {_pct(lat, 0.99) * 1e3:.0f} ms, max {lat[-1] * 1e3:.0f} ms"
    ]
    if run["stages"]:
        lines.append("  stage (last member of the group)   p50 ms    p99 ms")
        names = {
            "queue": "publish (before flush) -> consumed",
            "score": "consumed -> scored",
            "park": "scored -> parked",
            "decide": "parked -> decided",
            "send": "decided -> verdict record",
            "deliver": "record -> trainer",
        }
        for k, v in run["stages"].items():
            lines.append(f"  {names[k]:34} {max(0.0, _pct(v, 0.5)) * 1e3:7.1f}  {max(0.0, _pct(v, 0.99)) * 1e3:8.1f}")
    return lines


async def _main(args: argparse.Namespace) -> int:
    with (
        tempfile.TemporaryDirectory(prefix="prm-bench-") as tmp,
        LocalStack(Path(tmp) / "stack", broker=args.broker) as stack,
    ):
        name = uuid.uuid4().hex[:8]
        cfg = _config(stack, name, args.concurrency, args.compression, args.verdict_tokens)
        await ensure_topics(cfg.kafka, cfg.topics)
        pairs = max(1, args.pairs)
        groups = _groups(
            pairs * args.groups + 2 * args.latency_groups, args.group_size, args.turns, args.tokens, f"b{name}-"
        )
        rounds = [groups[r * args.groups : (r + 1) * args.groups] for r in range(pairs)]
        trajectories = [t for g in rounds[0] for t in g]
        mean_kib = statistics.mean(len(v) for _, v, _ in _payloads(rounds[0])) / 1024
        print(
            f"workload: {args.groups} groups x {args.group_size} sessions per round, {pairs} rounds, {args.turns} "
            f"turns, <= {args.tokens} output tokens/turn, {mean_kib:.0f} KiB/trajectory on the wire; verdicts "
            f"carry tokens {args.verdict_tokens}; broker {args.broker}"
        )
        inproc = await _runner_baseline(cfg, trajectories)
        alone = await _ledger_alone(cfg, trajectories)
        work = Path(tmp) / "workers"
        work.mkdir()
        result = await _pipeline(cfg, rounds, args.workers, work, groups[pairs * args.groups :], stack.redis_url)
    e2e, redis, n = result["rate"], result["redis"], result["trajectories"]
    ratios = sorted(a / b for a, b in result["pairs"])
    raws = sorted(b for _, b in result["pairs"])
    rates = sorted(a for a, _ in result["pairs"])
    print()
    print(f"{'path (median of the rounds, range)':52} {'traj/s':>18} {'ratio':>8}")
    print(
        f"{f'(a) pipeline: publish -> {args.workers} workers -> verdict':52} "
        f"{e2e:6.0f} ({rates[0]:.0f}-{rates[-1]:.0f})"
    )
    print(
        f"{'(b) raw aiokafka produce+consume, same bytes':52} "
        f"{statistics.median(raws):6.0f} ({raws[0]:.0f}-{raws[-1]:.0f}) "
        f"{statistics.median(ratios):8.2f}  (a)/(b) per round, range {ratios[0]:.2f}-{ratios[-1]:.2f}"
    )
    print(f"{'(c) in-process PRMRunner, same trajectories':52} {inproc:6.0f} {e2e / inproc:20.2f}  (a)/(c)")
    print(f"verdict record: {result['verdict_bytes'] / 1024:.1f} KiB per trajectory (value, before compression)")
    print()
    print(
        f"Redis per trajectory during (a): {redis['usec'] / n:.1f} µs in commands (INFO commandstats), "
        f"{redis['cpu_s'] / n * 1e6:.1f} µs server CPU (INFO cpu), "
        f"{redis['in'] / n / 1024:.1f} KB in, {redis['out'] / n / 1024:.1f} KB out, "
        f"{redis['scripts'] / n:.2f} script calls + {(redis['calls'] - redis['scripts']) / n:.2f} other commands; "
        f"{redis['all_calls'] / n:.2f} commands in all (INFO commandstats, scripts' own commands included)"
    )
    top = sorted(redis["by_command"].items(), key=lambda kv: -kv[1][1])[:6]
    print("  " + ", ".join(f"{k} {c / n:.2f} calls {u / n:.1f} µs" for k, (c, u) in top))
    print(
        f"(d) the ledger's calls alone (6,000 members, no Kafka): {alone['usec']:.1f} µs in commands, "
        f"{alone['cpu_us']:.1f} µs server CPU, {alone['in'] / 1024:.1f} KB in, {alone['out'] / 1024:.1f} KB out, "
        f"{alone['scripts']:.2f} script calls per trajectory"
    )
    print()
    for line in _latency_lines("10%", result["low"]) + _latency_lines("50%", result["half"]):
        print(line)
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
    p.add_argument("--pairs", type=int, default=5, help="interleaved rounds of (b) raw baseline then (a) pipeline")
    p.add_argument(
        "--verdict-tokens",
        choices=["inline", "reference"],
        default="inline",
        help="worker.verdict_tokens for the workers",
    )
    p.add_argument(
        "--broker",
        choices=BROKERS,
        default="tansu",
        help="the embedded broker: tansu (the default stack's) or noida (noida-db, the 'bench' extra)",
    )
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
