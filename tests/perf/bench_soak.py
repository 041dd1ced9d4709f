"""Endurance: the whole pipeline at half of its peak rate for N minutes (``prm-pipeline bench soak``).

Broker, Redis, two workers, a publisher and the trainer's verdict consumer run as
separate processes on the embedded stack (:mod:`tests.perf.stack_load`). After a
short burst that measures the peak rate, the publisher is paced at half of it, and
every ``--sample-s`` seconds the benchmark samples (:mod:`tests.perf.procstats`):
worker RSS, Redis ``used_memory`` and key count, broker RSS, the trainer consumer's
RSS and dedupe-set size, publish-to-verdict latency p50/p99 of the window, and the
backlog (groups published without a verdict yet).

It prints one row per sample, then each series' start, end and slope per hour over
the whole run and over its second half, and fails (exit 1) when something that must
be bounded is not:

* the trainer's dedupe set exceeds ``trainer.dedupe_max_seen`` (set so the run
  reaches it in its first third) — a hard bound;
* a worker, the trainer consumer or Redis grows in the second half by more than 25% of
  its level, or — when the second half lasts at least 10 minutes — its slope there
  is above 10% of its level per hour (and above 16 MiB/h);
* Redis holds more keys than the configuration allows (``redis.ttl_s`` and
  ``worker.dedupe_window_s`` both set to a sixth of the run): more than 1.25 x (groups
  finished within the dedupe sets' lifetime, 2.5 windows — each adds at most one set
  key — + two per open group + the deadline index) at any sample after the first.

The broker's RSS is reported but not judged: the embedded tansu broker keeps every
record in memory (its ``memory://`` engine has no retention), so it grows by design;
a real Kafka bounds its disk by ``retention.ms``.

Shares the machine with whatever else runs: absolute rates are the machine's, the
bounds are what this benchmark checks.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from infra.local import BROKERS
from infra.redis import make_redis
from prm_pipeline.observe import VerdictTail
from tests.perf.procstats import mib, percentile, read_proc, redis_reading, slope
from tests.perf.stack_load import SentLog, running_stack, stack_pids, while_alive
from tests.polling import eventually

GROUP_SIZE = 4
JUDGED = ("worker0", "worker1", "trainer")


async def _peak(children: Any, tail: VerdictTail, workdir: Path, groups: int, args: argparse.Namespace) -> float:
    """Trajectories/s of an unpaced burst of ``groups`` groups, publish to last verdict."""
    sent = SentLog(workdir / "sent-peak.log")
    children.start(
        "publisher",
        "--sent",
        str(sent.path),
        "--rate",
        "0",
        "--groups",
        str(groups),
        "--turns",
        str(args.turns),
        "--tokens",
        str(args.tokens),
        "--run-id",
        "peak",
        name="peak",
    )
    await eventually(
        while_alive(lambda: len(sent.poll()) >= groups, children, "peak"),
        timeout_s=300,
        what="the burst to be published",
    )
    t0 = min(sent.sent.values())
    await eventually(lambda: set(sent.sent) <= tail.arrivals.keys(), timeout_s=600, what="the burst's verdicts")
    children.stop("peak")
    return groups * GROUP_SIZE / (max(tail.arrivals[g] for g in sent.sent) - t0)


def _judge(name: str, ts: list[float], ys: list[float], half: int) -> tuple[float, float, str]:
    """(slope/h whole run, slope/h second half, verdict) for one series."""
    whole = slope(ts, ys) * 3600
    late_t, late_y = ts[half:], ys[half:]
    late = slope(late_t, late_y) * 3600
    level = max(1.0, sum(late_y) / max(1, len(late_y)))
    span_h = (late_t[-1] - late_t[0]) / 3600 if len(late_t) > 1 else 0.0
    grew = late * span_h
    if grew > 0.25 * level:
        return whole, late, f"GROWS ({grew / level:.0%} of its level in the second half)"
    floor = 16 * 1048576 if name != "redis keys" else 0
    if span_h >= 10 / 60 and late > 0.10 * level and late > floor:
        return whole, late, f"GROWS ({late / level:.0%} of its level per hour)"
    return whole, late, "bounded"


async def _soak(args: argparse.Namespace, workdir: Path) -> int:
    minutes = args.minutes
    ttl_s = args.ttl_s or max(20, int(minutes * 60 / 6))
    sample_s = args.sample_s or min(60.0, max(5.0, minutes * 60 / 18))
    name = uuid.uuid4().hex[:8]
    # the workers' dedupe window is the run's bound for finished groups, like redis.ttl_s for the rest
    async with running_stack(
        workdir, name, broker=args.broker, ttl_s=ttl_s, group_timeout_s=120, dedupe_window_s=float(ttl_s)
    ) as (stack, cfg, workers, children):
        tail = VerdictTail(cfg, decode=False)
        await tail.start()
        redis = make_redis(cfg.redis)
        try:
            # warm-up: workers joined and scoring
            warm = SentLog(workdir / "sent-warm.log")
            children.start("publisher", "--sent", str(warm.path), "--groups", "2", "--run-id", "warm", name="warm")
            await eventually(
                lambda: len(warm.poll()) == 2 and set(warm.sent) <= tail.arrivals.keys(),
                timeout_s=120,
                what="the warm-up verdicts (workers joining)",
            )
            children.stop("warm")
            peak = await _peak(children, tail, workdir, args.peak_groups, args)
            rate = peak / 2 if not args.max_rate else min(peak / 2, args.max_rate)
            groups_per_s = rate / GROUP_SIZE
            dedupe_max = args.dedupe_max or max(100, int(groups_per_s * minutes * 60 / 3))
            print(
                f"peak {peak:.0f} trajectories/s; soaking at {rate:.0f}/s ({groups_per_s:.1f} groups/s) for "
                f"{minutes} min, sampling every {sample_s:.0f} s; redis.ttl_s=worker.dedupe_window_s={ttl_s}, "
                f"trainer.dedupe_max_seen={dedupe_max}",
                flush=True,
            )

            children.start("trainer", env={"PRM_TRAINER_DEDUPE_MAX_SEEN": str(dedupe_max)})
            sent = SentLog(workdir / "sent-soak.log")
            children.start(
                "publisher",
                "--sent",
                str(sent.path),
                "--rate",
                f"{rate:.3f}",
                "--turns",
                str(args.turns),
                "--tokens",
                str(args.tokens),
                "--run-id",
                "soak",
            )
            rows: list[dict[str, float]] = []
            t0 = time.perf_counter()
            prev = t0
            broker_cpu0 = read_proc(stack.broker.pid)  # the broker's CPU per window: its cost as data accumulates
            header = (
                f"{'min':>5} {'w0 RSS':>8} {'w1 RSS':>8} {'trainer':>8} {'dedupe':>7} {'broker':>8} "
                f"{'redis mem':>9} {'keys':>7} {'p50 ms':>7} {'p99 ms':>7} {'backlog':>7} {'verdicts':>8} {'broker CPU':>10}"
            )
            print(header, flush=True)
            while (now := time.perf_counter()) - t0 < minutes * 60:
                await asyncio.sleep(min(sample_s, t0 + minutes * 60 - now) if rows else 1.0)
                for n in ("publisher", "trainer"):
                    children.check_alive(n)
                now = time.perf_counter()
                pids = stack_pids(stack, workers, children)
                procs = {k: read_proc(p) for k, p in pids.items()}
                rr = await redis_reading(redis)
                st = children.status("trainer")
                s = sent.poll()
                window = [
                    tail.arrivals[g] - t for g, t in s.items() if g in tail.arrivals and prev < tail.arrivals[g] <= now
                ]
                row = {
                    "t": now - t0,
                    **{f"{k}_rss": float(v.rss_bytes) for k, v in procs.items() if v is not None},
                    "redis_used": rr["used_memory"],
                    "redis_keys": rr["keys"],
                    "dedupe": float(st.get("dedupe_size", 0)),
                    "p50": percentile(window, 0.5) * 1e3,
                    "p99": percentile(window, 0.99) * 1e3,
                    "backlog": float(sum(1 for g in s if g not in tail.arrivals)),
                    # what the configuration allows: at most one dedupe-set key per group finished
                    # within the sets' lifetime (2.5 x worker.dedupe_window_s = ttl_s here: buckets
                    # of half a window, each kept a window and two buckets after its last write),
                    # two keys per open group, the deadline index
                    "expected_keys": float(
                        sum(1 for t in tail.arrivals.values() if t > now - 2.5 * ttl_s)
                        + 2 * sum(1 for g in s if g not in tail.arrivals)
                        + 1
                    ),
                    "verdicts": float(len(window)),
                    "broker_cores": (
                        (procs["broker"].cpu_s - broker_cpu0.cpu_s) / (now - prev)
                        if procs.get("broker") and broker_cpu0
                        else float("nan")
                    ),
                }
                rows.append(row)
                prev, broker_cpu0 = now, procs.get("broker")
                print(
                    f"{row['t'] / 60:5.1f} {row.get('worker0_rss', 0) / 1048576:8.1f} "
                    f"{row.get('worker1_rss', 0) / 1048576:8.1f} {row.get('trainer_rss', 0) / 1048576:8.1f} "
                    f"{row['dedupe']:7.0f} {row.get('broker_rss', 0) / 1048576:8.1f} "
                    f"{row['redis_used'] / 1048576:9.1f} {row['redis_keys']:7.0f} {row['p50']:7.0f} "
                    f"{row['p99']:7.0f} {row['backlog']:7.0f} {row['verdicts']:8.0f} {row['broker_cores']:9.0%}",
                    flush=True,
                )
            children.stop("publisher")
            s = sent.poll()
            await eventually(lambda: set(s) <= tail.arrivals.keys(), timeout_s=300, what="the last verdicts")
            st = children.status("trainer")
            published = len(s)
        finally:
            await redis.aclose()
            await tail.aclose()
    return _report(rows, dedupe_max, published, st, ttl_s, args.p99_goal_ms)


def _report(
    rows: list[dict[str, float]],
    dedupe_max: int,
    published: int,
    trainer: dict[str, Any],
    ttl_s: int,
    p99_goal_ms: float = 100.0,
) -> int:
    half = len(rows) // 2
    ts = [r["t"] for r in rows]
    failures: list[str] = []
    print()
    print(f"{'series':20} {'start':>12} {'end':>12} {'slope/h (all)':>15} {'slope/h (2nd half)':>19}  check")
    series = [
        ("worker0 RSS", "worker0_rss", True),
        ("worker1 RSS", "worker1_rss", True),
        ("trainer RSS", "trainer_rss", True),
        ("redis used_memory", "redis_used", True),
        ("redis keys", "redis_keys", False),
        ("broker RSS", "broker_rss", False),
        ("trainer dedupe set", "dedupe", False),
    ]
    for label, key, judged in series:
        ys = [r.get(key, 0.0) for r in rows]
        whole, late, verdict = _judge("redis keys" if key == "redis_keys" else label, ts, ys, half)
        memory = key.endswith("_rss") or key == "redis_used"
        fmt = (lambda v: mib(v)) if memory else (lambda v: f"{v:.0f}")
        if key == "redis_keys":  # a bound from configuration, not a slope: keys follow the load
            excess = max(r["redis_keys"] / max(1.0, r["expected_keys"]) for r in rows[1:] or rows)
            verdict = (
                f"<= {excess:.2f} x what dedupe_window_s=ttl_s={ttl_s} allows"
                if excess <= 1.25
                else f"EXCEEDS what dedupe_window_s=ttl_s={ttl_s} allows ({excess:.2f} x)"
            )
        elif not judged:
            verdict = (
                "not judged: the embedded broker's own (docs/capacity.md)"
                if key == "broker_rss"
                else f"max {max(ys):.0f} <= bound {dedupe_max}"
                if max(ys) <= dedupe_max
                else f"EXCEEDS bound {dedupe_max}"
            )
        if verdict.startswith(("GROWS", "EXCEEDS")):
            failures.append(f"{label}: {verdict}")
        print(f"{label:20} {fmt(ys[0]):>12} {fmt(ys[-1]):>12} {fmt(whole):>15} {fmt(late):>19}  {verdict}")
    p50 = [r["p50"] for r in rows if r["verdicts"]]
    p99 = [r["p99"] for r in rows if r["verdicts"]]
    print(
        f"latency per window: p50 {min(p50):.0f}-{max(p50):.0f} ms, p99 {min(p99):.0f}-{max(p99):.0f} ms; "
        f"backlog at end of windows {min(r['backlog'] for r in rows):.0f}-{max(r['backlog'] for r in rows):.0f} groups"
    )
    over = sum(1 for v in p99 if not v <= p99_goal_ms)
    print(
        f"p99 <= {p99_goal_ms:.0f} ms in {len(p99) - over} of {len(p99)} windows with verdicts (reported, not judged)"
    )
    print(
        f"groups published {published}, trainer batches {trainer.get('batches')}, "
        f"duplicates dropped by the trainer {trainer.get('duplicates')}"
    )
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("OK: everything judged stays bounded")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=None, help="default: 60 s, or run/18 for short runs")
    p.add_argument("--ttl-s", type=int, default=None, help="redis.ttl_s (default: a sixth of the run)")
    p.add_argument(
        "--dedupe-max",
        type=int,
        default=None,
        help="trainer.dedupe_max_seen (default: a third of the groups the run publishes)",
    )
    p.add_argument("--peak-groups", type=int, default=150)
    p.add_argument("--max-rate", type=float, default=None, help="cap on the soak rate, trajectories/s")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument(
        "--p99-goal-ms",
        type=float,
        default=100.0,
        help="report the windows whose p99 is above this (use --sample-s 60 for one-minute windows)",
    )
    p.add_argument(
        "--broker",
        choices=BROKERS,
        default="tansu",
        help="the embedded broker: tansu (the default stack's) or noida (noida-db, the 'bench' extra)",
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="prm-soak-") as tmp:
        return asyncio.run(_soak(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
