"""Capacity figures per component (``prm-pipeline bench capacity``): what docs/capacity.md is built from.

Runs broker, Redis, two workers, a publisher and the trainer's verdict consumer as
separate processes (:mod:`tests.perf.stack_load`), publishes ``--seconds`` worth of
trajectories at ``--rate`` per second, waits until the trainer consumed every group,
and reports from the kernel and the servers (:mod:`tests.perf.procstats`):

* CPU-seconds per 1,000 trajectories of each process (``/proc/PID/stat``);
* bytes per trajectory on each Kafka path: record bytes (key + value + headers, as
  produced, before compression) per topic, read back from the topics, and the bytes
  actually sent to and from the broker (compressed batches plus protocol), counted by
  a loopback proxy every client goes through (:mod:`tests.perf.kafka_proxy`) — so the
  consumers' fetches are included;
* Redis: bytes in and out, CPU and commands per trajectory (``INFO``), and the memory
  of a parked member and of a finished group in the dedupe sets (``MEMORY USAGE``): as
  measured (small sets, key overhead included) and in a scratch set of 3,000
  fingerprints, the size a set reaches at 100k trajectories/s (what the sizing uses).

``--json FILE`` writes the figures for docs/capacity.md. The benchmark process only
watches (status files, ``/proc``, ``INFO``): it reads no topic while measuring, so the
broker's bytes out are the workers' and the trainer's fetches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from infra.local import BROKERS
from infra.redis import make_redis
from tests.integration.harness import read_topic
from tests.perf.procstats import read_proc, redis_reading
from tests.perf.stack_load import running_stack, stack_pids, while_alive
from tests.polling import eventually, poll_until

GROUP_SIZE = 4
PROCESSES = ("broker", "redis", "worker0", "worker1", "publisher", "trainer")


async def _memory_sample(redis: Any, pattern: str, limit: int = 50) -> tuple[float, float]:
    """(mean ``MEMORY USAGE`` bytes, mean parked members) of up to ``limit`` group hashes matching
    ``pattern``: the ledger keeps a group in one hash, its members as ``m:<trajectory_id>`` fields
    (the state fields and the key's overhead are charged to the members)."""
    sizes, entries = [], []
    async for key in redis.scan_iter(match=pattern, count=500):
        sizes.append(await redis.memory_usage(key, samples=0) or 0)
        entries.append(sum(1 for field in await redis.hkeys(key) if field.startswith(b"m:")))
        if len(sizes) >= limit:
            break
    if not sizes:
        return float("nan"), float("nan")
    return sum(sizes) / len(sizes), sum(entries) / len(entries)


async def _done_sets(redis: Any, prefix: str) -> float:
    """Mean ``MEMORY USAGE`` bytes per finished group over the ledger's dedupe sets."""
    size = members = 0
    for pattern in (f"{prefix}:done:*", f"{prefix}:{{*}}:done:*"):  # standalone, cluster
        async for key in redis.scan_iter(match=pattern, count=1000):
            size += await redis.memory_usage(key, samples=0) or 0
            members += await redis.scard(key)
    return size / members if members else float("nan")


async def _scratch_set_bytes(redis: Any, key: str, n: int) -> float:
    """Bytes per member of a set of ``n`` 12-byte fingerprints (a dedupe set at scale)."""
    import os

    await redis.delete(key)
    try:
        await redis.sadd(key, *(os.urandom(12) for _ in range(n)))
        return (await redis.memory_usage(key, samples=0) or 0) / n
    finally:
        await redis.delete(key)


def _record_bytes(records: list[Any]) -> int:
    return sum(
        len(r.key or b"") + len(r.value or b"") + sum(len(k) + len(v or b"") for k, v in r.headers) for r in records
    )


async def _capacity(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    name = uuid.uuid4().hex[:8]
    async with running_stack(
        workdir,
        name,
        counted=True,
        broker=args.broker,
        ttl_s=3600,
        group_timeout_s=120,
        verdict_tokens=args.verdict_tokens,
    ) as (stack, cfg, workers, children):
        redis = make_redis(cfg.redis)
        try:
            children.start("trainer")
            children.start("publisher", "--groups", "2", "--run-id", "warm", name="warm")
            await eventually(
                while_alive(lambda: children.status("trainer").get("groups", 0) >= 2, children, "trainer"),
                timeout_s=120,
                what="the warm-up groups to reach the trainer",
            )
            children.stop("warm")
            await redis.config_resetstat()
            pids = stack_pids(stack, workers, children)
            # what each process costs with nothing to do: the per-second part of its cost
            # (polling, heartbeats, sweeps), read apart from the per-trajectory part below
            idle0, i0 = {k: read_proc(p) for k, p in pids.items()}, time.perf_counter()
            await asyncio.sleep(args.idle_s)  # a measurement window, not synchronisation
            idle1, idle_s = {k: read_proc(p) for k, p in pids.items()}, time.perf_counter() - i0
            idle = {k: (idle1[k].cpu_s - idle0[k].cpu_s) / idle_s for k in PROCESSES if idle0.get(k) and idle1.get(k)}
            idle_wakeups = {k: (idle1[k].wakeups - idle0[k].wakeups) / idle_s for k in idle}
            n_groups = int(args.rate * args.seconds / GROUP_SIZE)
            children.start(
                "publisher",
                "--rate",
                str(args.rate),
                "--groups",
                str(n_groups),
                "--turns",
                str(args.turns),
                "--tokens",
                str(args.tokens),
                "--run-id",
                "cap",
            )
            pids["publisher"] = children.procs["publisher"].pid
            before = {k: read_proc(p) for k, p in pids.items()}
            k0 = (stack.proxy.bytes_in, stack.proxy.bytes_out)
            r0 = await redis_reading(redis)
            t0 = time.perf_counter()
            await eventually(
                while_alive(lambda: children.status("trainer").get("groups", 0) >= 2 + n_groups, children, "trainer"),
                timeout_s=args.seconds * 5 + 120,
                what="every group to reach the trainer",
            )
            elapsed = time.perf_counter() - t0
            after = {k: read_proc(p) for k, p in pids.items()}
            k1 = (stack.proxy.bytes_in, stack.proxy.bytes_out)
            r1 = await redis_reading(redis)
            commandstats = await redis.info("commandstats")
            done_bytes = await _done_sets(redis, cfg.redis.key_prefix)
            done_at_scale = await _scratch_set_bytes(redis, f"{cfg.redis.key_prefix}:bench-scratch", 3000)
            # after the measured window: groups that never complete keep their members parked
            children.start(
                "publisher",
                "--groups",
                "20",
                "--members",
                str(GROUP_SIZE - 1),
                "--turns",
                str(args.turns),
                "--tokens",
                str(args.tokens),
                "--run-id",
                "open",
                name="open",
            )
            await eventually(lambda: children.status("open").get("done", False), timeout_s=60, what="the open groups")
            pattern = f"{cfg.redis.key_prefix}:{{open-*}}:group"
            parked_bytes, parked_entries = (
                await poll_until(
                    lambda: _memory_sample(redis, pattern),
                    timeout_s=30,
                    interval_s=0.2,
                    accept=lambda sample: sample[1] >= GROUP_SIZE - 1,
                )
            ).last
        finally:
            await redis.aclose()
        trajectories = n_groups * GROUP_SIZE
        per_k = trajectories / 1000
        cpu = {k: (after[k].cpu_s - before[k].cpu_s) / per_k for k in PROCESSES if before.get(k) and after.get(k)}
        wakeups = {k: (after[k].wakeups - before[k].wakeups) / trajectories for k in cpu}
        topics: dict[str, float] = {}
        for label, topic in (("trajectories", cfg.topics.trajectories), ("verdicts", cfg.topics.verdicts)):
            records = await read_topic(cfg, topic, until=time.monotonic() + 120)
            ours = [r for r in records if (r.key or b"").startswith(b"cap-")]
            topics[label] = _record_bytes(ours) / trajectories
    admin = {"info", "dbsize", "scan", "type", "memory|usage", "config|resetstat", "client|setinfo", "hello", "auth"}
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in commandstats.items() if v.get("calls")}
    ledger_calls = {k: v for k, v in calls.items() if k not in admin}
    # time inside the ledger's commands: EVALSHA (its usec includes the commands its script
    # calls) plus the index commands sent outside scripts; the rest of the server CPU is
    # I/O, client handling and background work, which does not grow with the load
    usec = {k.removeprefix("cmdstat_"): v.get("usec", 0) for k, v in commandstats.items()}
    commands_us = sum(usec.get(k, 0) for k in ("evalsha", "zadd", "zrem", "zrangebyscore"))
    result = {
        "workload": {
            "trajectories": trajectories,
            "group_size": GROUP_SIZE,
            "turns": args.turns,
            "output_tokens": [args.tokens // 2, args.tokens],
            "rate": args.rate,
            "elapsed_s": elapsed,
            "verdict_tokens": args.verdict_tokens,
            "broker": args.broker,
            "achieved_rate": trajectories / elapsed,
        },
        "cpu_s_per_1000": cpu,
        # cores used while idle, and the CPU per 1,000 trajectories net of that idle cost
        "idle_cores": idle,
        "cpu_s_per_1000_net_of_idle": {k: v - idle.get(k, 0.0) * elapsed / per_k for k, v in cpu.items()},
        # times each process blocked and was woken: per trajectory under load, per second idle
        "wakeups_per_trajectory": wakeups,
        "idle_wakeups_per_s": idle_wakeups,
        "kafka_record_bytes_per_trajectory": topics,
        "broker_wire_bytes_per_trajectory": {
            "in": (k1[0] - k0[0]) / trajectories,
            "out": (k1[1] - k0[1]) / trajectories,
        },
        "redis_per_trajectory": {
            "in_bytes": (r1["net_in"] - r0["net_in"]) / trajectories,
            "out_bytes": (r1["net_out"] - r0["net_out"]) / trajectories,
            "cpu_us": (r1["cpu_s"] - r0["cpu_s"]) / trajectories * 1e6,
            "commands_us": commands_us / trajectories,
            "commands": sum(ledger_calls.values()) / trajectories,  # Lua-called commands included
            "commandstats_calls": {k: v / trajectories for k, v in ledger_calls.items()},
        },
        "redis_memory": {
            "parked_member_bytes": parked_bytes / parked_entries,
            "dedupe_bytes_per_group_measured": done_bytes,
            "dedupe_bytes_per_group_at_scale": done_at_scale,
        },
    }
    return result


def _print(r: dict[str, Any]) -> None:
    w = r["workload"]
    print(
        f"workload: {w['trajectories']} trajectories in groups of {w['group_size']}, {w['turns']} turns, "
        f"{w['output_tokens'][0]}-{w['output_tokens'][1]} output tokens/turn; paced at {w['rate']:.0f}/s, "
        f"achieved {w['achieved_rate']:.0f}/s; verdict token turns {w.get('verdict_tokens', 'inline')}; "
        f"broker {w.get('broker', 'tansu')}"
    )
    print()
    idle, net = r.get("idle_cores", {}), r.get("cpu_s_per_1000_net_of_idle", {})
    wake, idle_wake = r.get("wakeups_per_trajectory", {}), r.get("idle_wakeups_per_s", {})
    nan = float("nan")
    print(
        f"{'process':12} {'CPU-s per 1,000 trajectories':>30} {'idle, % of a core':>18} {'net of idle':>12} "
        f"{'wake-ups per trajectory':>24} {'idle wake-ups/s':>16} {'idle CPU per wake-up':>21}"
    )

    def row(label: str, cpu: float, idle_cores: float, net_cpu: float, wakes: float, idle_wakes: float) -> None:
        per_wake = idle_cores / idle_wakes * 1e6 if idle_wakes else nan
        print(
            f"{label:12} {cpu:30.3f} {idle_cores * 100:18.1f} {net_cpu:12.3f} {wakes:24.1f} {idle_wakes:16.0f} "
            f"{per_wake:18.0f} us"
        )

    for k, v in r["cpu_s_per_1000"].items():
        row(k, v, idle.get(k, nan), net.get(k, nan), wake.get(k, nan), idle_wake.get(k, nan))
    workers = [k for k in r["cpu_s_per_1000"] if k.startswith("worker")]
    row(
        "all workers",
        sum(r["cpu_s_per_1000"][k] for k in workers),
        sum(idle.get(k, nan) for k in workers),
        sum(net.get(k, nan) for k in workers),
        sum(wake.get(k, nan) for k in workers),
        sum(idle_wake.get(k, nan) for k in workers),
    )
    print()
    t, b = r["kafka_record_bytes_per_trajectory"], r["broker_wire_bytes_per_trajectory"]
    print("Kafka bytes per trajectory")
    print(f"  records produced, uncompressed: trajectories {t['trajectories']:.0f} B, verdicts {t['verdicts']:.0f} B")
    print(
        f"  on the wire to/from the broker (compressed, all clients, all requests): in {b['in']:.0f} B, "
        f"out {b['out']:.0f} B"
    )
    rr, m = r["redis_per_trajectory"], r["redis_memory"]
    print("Redis per trajectory")
    print(
        f"  in {rr['in_bytes']:.0f} B, out {rr['out_bytes']:.0f} B, server CPU {rr['cpu_us']:.1f} us "
        f"(in the ledger's commands {rr.get('commands_us', float('nan')):.1f} us), {rr['commands']:.2f} commands"
    )
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(rr["commandstats_calls"].items(), key=lambda kv: -kv[1])))
    print(
        f"Redis memory: parked member {m['parked_member_bytes']:.0f} B; per finished group in the dedupe sets "
        f"{m['dedupe_bytes_per_group_measured']:.0f} B as measured (small sets), "
        f"{m['dedupe_bytes_per_group_at_scale']:.1f} B in a 3,000-member set"
    )


def sizing(r: dict[str, Any], a: argparse.Namespace) -> list[dict[str, Any]]:
    """docs/capacity.md's sizing table from the measured figures and the stated assumptions."""
    cpu = r["cpu_s_per_1000"]
    workers_cpu = sum(v for k, v in cpu.items() if k.startswith("worker")) / 1000  # s per trajectory
    wire = r["broker_wire_bytes_per_trajectory"]
    rd, mem = r["redis_per_trajectory"], r["redis_memory"]
    nic = a.nic_gbit * 1e9 / 8 * a.nic_util  # usable bytes/s per direction per machine
    rows = []
    for rate in (1_000, 10_000, 100_000):
        produce = rate * wire["in"]  # client -> leaders
        fetch = rate * wire["out"]  # leaders -> consumers
        repl = (a.rf - 1) * produce  # leaders -> followers
        broker_in, broker_out = produce + repl, fetch + repl  # cluster-wide, each direction
        parked = rate * a.open_s * mem["parked_member_bytes"]
        dedupe = rate / r["workload"]["group_size"] * a.dedupe_s * mem["dedupe_bytes_per_group_at_scale"]
        redis_mem = (parked + dedupe) * 1.5  # allocator + replication buffers headroom
        rows.append(
            {
                "rate": rate,
                "worker_cores": rate * workers_cpu / a.util,
                "broker_cores": rate * cpu.get("broker", 0) / 1000 * a.rf / a.util,
                "broker_in_MBps": broker_in / 1e6,
                "broker_out_MBps": broker_out / 1e6,
                "brokers_by_network": max(a.rf, math.ceil(max(broker_in, broker_out) / nic)),
                "redis_net_MBps": rate * (rd["in_bytes"] + rd["out_bytes"]) / 1e6,
                "redis_shards_cpu": math.ceil(rate * rd["cpu_us"] / 1e6 / a.redis_util),
                "redis_shards_net": math.ceil(rate * max(rd["in_bytes"], rd["out_bytes"]) / nic),
                "redis_memory_GB": redis_mem / 1e9,
                "redis_shards_memory": math.ceil(redis_mem / (a.shard_memory_gb * 1e9)),
            }
        )
    return rows


def _print_sizing(rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    print()
    print(
        f"sizing (assumptions: {a.util:.0%} CPU target, Redis shard {a.redis_util:.0%} of one core, "
        f"{a.nic_gbit:g} Gbit/s NICs at {a.nic_util:.0%}, RF {a.rf}, members parked {a.open_s:g} s, "
        f"finished groups held {a.dedupe_s:g} s, {a.shard_memory_gb:g} GB per Redis shard)"
    )
    print(
        f"{'traj/s':>8} {'worker cores':>12} {'broker cores':>12} {'broker in/out MB/s':>19} {'brokers (net)':>13} "
        f"{'Redis MB/s':>10} {'Redis GB':>9} {'shards cpu/net/mem':>19}"
    )
    for x in rows:
        print(
            f"{x['rate']:>8,} {x['worker_cores']:12.1f} {x['broker_cores']:12.1f} "
            f"{x['broker_in_MBps']:>9.0f}/{x['broker_out_MBps']:<9.0f} {x['brokers_by_network']:13d} "
            f"{x['redis_net_MBps']:10.0f} {x['redis_memory_GB']:9.1f} "
            f"{x['redis_shards_cpu']:>7d}/{x['redis_shards_net']}/{x['redis_shards_memory']}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench capacity", description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=60.0, help="trajectories/s (keep it well below the machine's peak)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the measured load")
    p.add_argument("--idle-s", type=float, default=10.0, help="length of the idle window measured before the load")
    p.add_argument("--turns", type=int, default=8, help="turns per session (bench pipeline's workload)")
    p.add_argument("--tokens", type=int, default=512, help="at most this many output tokens per turn")
    p.add_argument(
        "--verdict-tokens",
        choices=("inline", "reference"),
        default="inline",
        help="worker.verdict_tokens for the workers (reference: the trainer reads the turns back)",
    )
    p.add_argument(
        "--broker",
        choices=BROKERS,
        default="tansu",
        help="the embedded broker: tansu (the default stack's) or noida (noida-db, the 'bench' "
        "extra), to tell the broker's costs from the pipeline's (docs/capacity.md)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--from-json", default=None, metavar="FILE", help="print from a previous --json run (no load)")
    g = p.add_argument_group("sizing assumptions (docs/capacity.md)")
    g.add_argument("--util", type=float, default=0.6, help="target CPU utilisation of workers and brokers")
    g.add_argument("--redis-util", type=float, default=0.5, help="target utilisation of a Redis shard's one core")
    g.add_argument("--nic-gbit", type=float, default=10.0)
    g.add_argument("--nic-util", type=float, default=0.5)
    g.add_argument("--rf", type=int, default=3, help="Kafka replication factor")
    g.add_argument("--open-s", type=float, default=60.0, help="mean seconds a scored member stays parked")
    g.add_argument(
        "--dedupe-s",
        type=float,
        default=8_100.0,
        help="seconds a finished group's fingerprint stays in Redis: 2-2.5 x worker.dedupe_window_s "
        "(default 3600) with the ledger's buckets, 2.25 x on average",
    )
    g.add_argument("--shard-memory-gb", type=float, default=25.0)
    args = p.parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="prm-capacity-") as tmp:
            result = asyncio.run(_capacity(args, Path(tmp)))
    _print(result)
    _print_sizing(sizing(result, args), args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
