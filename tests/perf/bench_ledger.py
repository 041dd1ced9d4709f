"""Redis work per trajectory of the group ledger alone (``prm-pipeline bench ledger``).

Drives the real :class:`~scoring_workers.ledger.GroupLedger` against a real embedded
Redis (valkey) the way the workers do, without Kafka or scorers: two worker-shaped
clients, each polling its share of the groups (polls of up to ``worker.poll_max_records``
records), scoring each member for a random time, parking the members concurrently (parks
in flight together share one call), finishing each group when its last member decides it,
sweeping every ``worker.sweep_interval_s`` and beating. A ledger that has ``expect`` (the
worker probes only records a previous owner of the partition may have read) probes only
``--probe-fraction`` of the polls (the rest are announced with ``expect``); one without
probes every poll (``probe_many``). A ledger that has ``finish_soon`` finishes lazily (the
finish rides along with the next call; the pending ones are flushed before the counters
are read); one without awaits each ``finish``. Groups
are published whole (as ``bench capacity``'s publisher does) or, with ``--spread-ms``,
member by member over that span (members then land in different polls).

Counted by the server (``INFO commandstats``, ``INFO cpu``), per trajectory:

* commands: every command Redis ran, those a script ran included (what the ACL and
  ``commandstats`` see);
* in-command µs: the usec of EVALSHA (its scripts' commands included) and of the index
  commands (ZADD, ZREM, ZRANGEBYSCORE — also counted when a script ran them, so an
  overestimate there);
* round trips: ``total_reads_processed`` (``INFO stats``), the reads from client sockets
  the server woke up for — one per pipeline or call that arrives on its own;
* server CPU µs: ``used_cpu_user + used_cpu_sys`` of the Redis process, I/O and
  background work included (what sizing needs; noisy on a shared box);
* client CPU µs: this process's CPU (the two worker-shaped clients and the simulation
  around them, the same for both ledgers), for what the ledger costs the workers.

``--compare REF`` runs the same workload, in the same run and on the same server, with
the ledger of git revision ``REF`` too (old, then new, ``--repeat`` times), so the two
read side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path
from typing import Any

import msgspec

from infra.config import RedisConfig
from infra.local import redis_service
from infra.schema import PRMTurnResult, SessionResult

ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"info", "config|resetstat", "client|setinfo", "hello", "auth", "script|load", "ping"}
INDEX = ("zadd", "zrem", "zrangebyscore", "zremrangebyscore")
WORKERS = 2
POLL_MAX_RECORDS = 256
SWEEP_S = 0.5


def _result(tid: str, turns: int = 4) -> SessionResult:
    """A scored member shaped like the pipeline's: per-turn results and stats, no token turns."""
    return SessionResult(
        session_id=f"s-{tid}",
        trajectory_id=tid,
        status="scored",
        outcome_reward=1.0,
        policy_version=3,
        turn_results=[
            PRMTurnResult(interaction_id=f"{tid}-i{i}", scorer_name="length_budget", reward=0.5 + i / 10)
            for i in range(turns)
        ],
        stats={"prm_mean": 0.61, "prm_min": 0.5, "turns": float(turns)},
        created_at=time.time(),
        scored_at=time.time(),
    )


def load_ledger_at(ref: str) -> type:
    """``GroupLedger`` as git revision ``ref`` has it (its scripts module loaded beside it)."""
    mods = {}
    for name in ("ledger_scripts", "ledger"):
        src = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:scoring_workers/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        src = src.replace("from scoring_workers.ledger_scripts import", "from _ref_ledger_scripts import")
        mod = types.ModuleType(f"_ref_{name}")
        sys.modules[mod.__name__] = mod
        exec(compile(src, f"{ref}:scoring_workers/{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["ledger"].GroupLedger


class _Meter:
    def __init__(self, client: Any) -> None:
        self.client = client

    async def _cpu(self) -> float:
        cpu = await self.client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    async def _reads(self) -> int:
        return int((await self.client.info("stats")).get("total_reads_processed", 0))

    async def reset(self) -> None:
        await self.client.config_resetstat()
        self.cpu0 = await self._cpu()
        self.reads0 = await self._reads()

    async def read(self) -> tuple[dict[str, tuple[int, int]], float]:
        self.reads = await self._reads() - self.reads0
        cpu = await self._cpu() - self.cpu0
        stats = await self.client.info("commandstats")
        calls = {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}
        return {k: v for k, v in calls.items() if k not in ADMIN}, cpu


async def _workload(
    ledger_cls: type,
    url: str,
    *,
    groups: int,
    group_size: int,
    rate: float | None,
    score_ms: float,
    spread_ms: float,
    inflight: int,
    probe_fraction: float = 1.0,
) -> dict[str, Any]:
    """One run: ``groups`` groups through ``WORKERS`` ledgers; returns per-trajectory figures."""
    cfg = RedisConfig(url=url, key_prefix=f"bench-{uuid.uuid4().hex[:6]}", ttl_s=600)
    ledgers = [ledger_cls.from_config(cfg) for _ in range(WORKERS)]
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(url)
    meter = _Meter(admin)
    queues: list[asyncio.Queue[tuple[str, str]]] = [asyncio.Queue() for _ in range(WORKERS)]
    slots = asyncio.Semaphore(inflight)
    finished = 0
    all_done = asyncio.Event()
    tasks: set[asyncio.Task[Any]] = set()
    rnd = random.Random(7)
    blobs = {i: _result(f"t{i}") for i in range(group_size)}

    async def member(w: int, gid: str, tid: str, probe: str) -> None:
        nonlocal finished
        assert probe == "new", probe
        await asyncio.sleep(rnd.uniform(0, score_ms) / 1000)
        i = int(tid.rsplit("-", 1)[1])
        led = ledgers[w]
        outcome, decision = await led.park(
            msgspec.structs.replace(blobs[i], trajectory_id=tid),
            group_id=gid,
            group_size=group_size,
            group_timeout_s=120,
            worker_id=f"w{w}",
            scorers=b"\x90",
            partition=w,
            offset=i,
        )
        if decision is not None and decision.outcome == "decided_now":
            assert len(decision.members) == group_size
            await asyncio.sleep(0.001)  # the verdict's produce
            if hasattr(led, "finish_soon"):
                led.finish_soon(gid)  # rides along with the next call
            else:
                await led.finish(gid)
            finished += 1
            slots.release()
            if finished == groups:
                all_done.set()

    async def poller(w: int) -> None:
        q = queues[w]
        while True:
            first = await q.get()
            batch = [first]
            while not q.empty() and len(batch) < POLL_MAX_RECORDS:
                batch.append(q.get_nowait())
            if hasattr(ledgers[w], "expect") and rnd.random() >= probe_fraction:
                ledgers[w].expect(batch)  # past the partition's mark: no probe
                probes = ["new"] * len(batch)
            else:
                probes = await ledgers[w].probe_many(batch)
            for (gid, tid), probe in zip(batch, probes):
                t = asyncio.create_task(member(w, gid, tid, probe))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

    async def arrive(w: int, gid: str) -> None:
        for i in range(group_size):
            if spread_ms and i:
                await asyncio.sleep(rnd.uniform(0, spread_ms) / group_size / 1000)
            queues[w].put_nowait((gid, f"{gid}-{i}"))

    async def publisher() -> None:
        t0 = time.perf_counter()
        for g in range(groups):
            await slots.acquire()
            if rate:
                delay = t0 + g * group_size / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            t = asyncio.create_task(arrive(g % WORKERS, f"grp-{g}"))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def background(w: int) -> None:
        await ledgers[w].beat(f"w{w}")
        while True:
            await asyncio.sleep(SWEEP_S * rnd.uniform(0.8, 1.2))
            assert not await ledgers[w].due_groups()  # nothing is overdue here: a plain index read

    try:
        await ledgers[0].probe_many([("warm", "up")])
        await ledgers[1].probe_many([("warm", "up")])
        await meter.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        loops = [
            asyncio.create_task(c)
            for c in (*(poller(w) for w in range(WORKERS)), *(background(w) for w in range(WORKERS)), publisher())
        ]
        await all_done.wait()
        elapsed, client_s = time.perf_counter() - t0, time.process_time() - c0
        for led in ledgers:
            if hasattr(led, "flush"):
                await led.flush()  # the finishes still lingering count too
        stats, cpu_s = await meter.read()
        for t in (*loops, *tasks):
            t.cancel()
        await asyncio.gather(*loops, *tasks, return_exceptions=True)
    finally:
        for led in ledgers:
            await led.aclose()
        await admin.aclose()
    n = groups * group_size
    return {
        "rate": n / elapsed,
        "commands": sum(c for c, _ in stats.values()) / n,
        "round_trips": meter.reads / n,
        "command_us": sum(stats.get(k, (0, 0))[1] for k in ("evalsha", *INDEX)) / n,
        "cpu_us": cpu_s * 1e6 / n,
        "client_us": client_s * 1e6 / n,
        "by_command": {k: c / n for k, (c, _) in sorted(stats.items())},
        "usec_per_call": {k: u / max(c, 1) for k, (c, u) in sorted(stats.items())},
    }


def _fmt(runs: list[dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in runs]
    return f"{statistics.median(vals):7.2f} ({min(vals):.2f}-{max(vals):.2f})"


async def _main(a: argparse.Namespace) -> int:
    variants: list[tuple[str, type]] = []
    if a.compare:
        variants.append((a.compare, load_ledger_at(a.compare)))
    from scoring_workers.ledger import GroupLedger

    variants.append(("this checkout", GroupLedger))
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        svc = redis_service(tmp)
        svc.start()
        try:
            url = f"redis://127.0.0.1:{svc.port}/0"
            results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in variants}
            for _ in range(a.repeat):
                for name, cls in variants:
                    results[name].append(
                        await _workload(
                            cls,
                            url,
                            groups=a.groups,
                            group_size=a.group_size,
                            rate=a.rate,
                            score_ms=a.score_ms,
                            spread_ms=a.spread_ms,
                            inflight=a.inflight,
                            probe_fraction=a.probe_fraction,
                        )
                    )
        finally:
            svc.stop()
    pace = f"paced at {a.rate:g}/s" if a.rate else f"as fast as it goes ({a.inflight} groups in flight)"
    print(
        f"{a.groups} groups of {a.group_size}, {pace}, scoring 0-{a.score_ms:g} ms, members spread over "
        f"{a.spread_ms:g} ms; median (min-max) of {a.repeat} runs, per trajectory:"
    )
    print(f"probes: every poll for a ledger without expect, {a.probe_fraction:.0%} of polls for one with it")
    print(
        f"{'ledger':16} {'traj/s':>22} {'commands':>22} {'round trips':>22} {'in-command us':>22} "
        f"{'server CPU us':>22} {'client CPU us':>22}"
    )
    for name, runs in results.items():
        print(
            f"{name[:16]:16} {_fmt(runs, 'rate'):>22} {_fmt(runs, 'commands'):>22} {_fmt(runs, 'round_trips'):>22} "
            f"{_fmt(runs, 'command_us'):>22} {_fmt(runs, 'cpu_us'):>22} {_fmt(runs, 'client_us'):>22}"
        )
        last = runs[-1]["by_command"]
        print("  calls: " + ", ".join(f"{k} {v:.2f}" for k, v in last.items()))
        if a.verbose:
            print("  usec per call: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[-1]["usec_per_call"].items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prm-pipeline bench ledger", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=1000)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--rate", type=float, default=None, help="trajectories per second (default: as fast as it goes)")
    p.add_argument("--inflight", type=int, default=128, help="groups in flight at most")
    p.add_argument("--score-ms", type=float, default=20.0, help="each member scores for 0..this many ms")
    p.add_argument(
        "--spread-ms", type=float, default=0.0, help="a group's members arrive over this span (0: published whole)"
    )
    p.add_argument(
        "--probe-fraction",
        type=float,
        default=0.0,
        help="fraction of polls probed by a ledger that has expect (records below a partition's mark, "
        "e.g. after a rebalance); one without probes every poll",
    )
    p.add_argument("--compare", metavar="REF", help="also run the ledger of this git revision (e.g. main)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("-v", "--verbose", action="store_true", help="also print the usec per call of each command")
    return asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
