"""One scoring fleet, many experiments (``prm-pipeline bench fleet``): fairness, the judge pool, affinity.

* **(a) fairness** — experiments A and B are declared in the registry (as ``experiment
  add`` does) and served by ``--workers`` real ``prm-pipeline worker`` processes on the
  embedded stack. Both score with ``tests.scorers.SlowScorer`` (a fixed ``--delay-ms``
  per record: one-turn, one-member groups), so the fleet's peak is set by its slots, not
  by the CPU of a shared box. First the peak: the fleet's verdicts/s for A alone,
  flooded. Then, in ``--pairs`` interleaved pairs:

  - *alone*: B paced at 10% of the peak for ``--seconds``;
  - *flooded*: A's backlog, ``--backlog`` (10) times B's whole run, is published in
    one burst, and once A holds the workers B runs exactly as alone.

  Reported per run: B's publish-to-verdict latency p50 / p99 (and where it went: the
  p99 of each stage the verdict records), and for the flooded runs A's verdicts/s
  while B ran and what was left of A's backlog when B's run ended (it must outlast B's
  run, or B was not competing with a flood). The figure of merit is B's p99 flooded /
  p99 alone of the same pair (goal <= 2x), with the range over the pairs.
* **(b) degraded judge pool** and **(c) session affinity** — :mod:`tests.perf.bench_pool`'s
  two scenarios: three fake-judge replicas, one slowed 10x and one failing (the share of
  calls each answered, p99 judge call latency, votes lost — goal 0), and three healthy
  ones (the share of a session's calls that hit its own replica — goal >= 0.95).

A report, not a gate. Run: ``prm-pipeline bench fleet`` (``--only a|b|c`` for one section).
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

import msgspec

from infra.config import PipelineConfig, PRMConfig, PRMScorerConfig
from infra.experiments import trajectories_topic, verdicts_topic
from infra.kafka import ensure_topics
from infra.local import LocalStack
from infra.registry import ExperimentSpec, publish_spec
from infra.schema import ReadyTrajectory, decode_verdict
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from prm_pipeline.demo.synthetic import make_group
from prm_pipeline.observe import VerdictTail
from producers.publisher import TrajectoryPublisher
from tests.perf import bench_pool
from tests.perf.bench_pipeline import STAGES, _paced, _pct, _RawTail
from tests.perf.stack_load import ROOT, perf_config
from tests.polling import eventually

EXPERIMENTS = ("bench-a", "bench-b")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench fleet", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--only", choices=("a", "b", "c"), default=None, help="run one section only")
    a = p.add_argument_group("(a) fairness")
    a.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    a.add_argument("--concurrency", type=int, default=8, help="worker.concurrency of each worker (default 8)")
    a.add_argument("--delay-ms", type=float, default=250.0, help="scoring time of one record (default 250)")
    a.add_argument("--seconds", type=float, default=20.0, help="length of each of B's runs (default 20)")
    a.add_argument("--share", type=float, default=0.1, help="B's rate as a share of the peak (default 0.1)")
    a.add_argument("--backlog", type=float, default=10.0, help="A's backlog in B's whole runs (default 10)")
    a.add_argument("--pairs", type=int, default=2, help="interleaved (alone, flooded) pairs (default 2)")
    a.add_argument("--peak-records", type=int, default=400, help="A's records in the peak burst (default 400)")
    b = p.add_argument_group("(b), (c): bench pool's scenarios")
    b.add_argument("--pool-sessions", type=int, default=200, help="sessions per scenario (default 200)")
    args = p.parse_args(argv)
    if (
        min(args.workers, args.concurrency, args.pairs, args.peak_records, args.pool_sessions) <= 0
        or min(args.delay_ms, args.seconds, args.share, args.backlog) <= 0
    ):
        p.error("every number must be positive")
    return args


# --------------------------------------------------------------------------- (a) fairness
def _config(stack: LocalStack, name: str, args: argparse.Namespace) -> PipelineConfig:
    cfg = perf_config(stack, name, ttl_s=600, concurrency=args.concurrency, group_timeout_s=120)
    return msgspec.structs.replace(
        cfg,
        worker=msgspec.structs.replace(cfg.worker, allowed_scorer_modules=["scoring_workers.scorers", "tests.scorers"]),
    )


def _topics(cfg: PipelineConfig, experiment_id: str) -> Any:
    """``cfg.topics`` with the experiment's own trajectories and verdicts topics."""
    return msgspec.structs.replace(
        cfg.topics,
        trajectories=trajectories_topic(cfg.topics.trajectories, experiment_id),
        verdicts=verdicts_topic(cfg.topics.verdicts, experiment_id),
    )


def _records(experiment_id: str, prefix: str, n: int) -> list[list[ReadyTrajectory]]:
    """``n`` one-member, one-turn groups stamped with ``experiment_id`` (SlowScorer: one delay each)."""
    import numpy as np

    rng = np.random.default_rng(3)
    return [
        [
            msgspec.structs.replace(t, experiment_id=experiment_id)
            for t in make_group(f"{prefix}-{i:06d}", 1, rng=rng, turns=1, output_tokens=(8, 16))
        ]
        for i in range(n)
    ]


class _Fleet:
    """The two experiments' publishers and verdict tails (one asyncio loop, the bench process)."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.pub: dict[str, TrajectoryPublisher] = {}
        self.tail: dict[str, VerdictTail] = {}

    async def __aenter__(self) -> _Fleet:
        for e in EXPERIMENTS:
            topics = _topics(self.cfg, e)
            self.pub[e] = TrajectoryPublisher(self.cfg.kafka, self.cfg.topics, experiment=e)
            await self.pub[e].start()
            # B's verdicts are kept raw for the stage breakdown; A's are keys only (no CPU decoding them)
            cfg = msgspec.structs.replace(self.cfg, topics=topics)
            self.tail[e] = _RawTail(cfg) if e == EXPERIMENTS[1] else VerdictTail(cfg, decode=False)
            await self.tail[e].start()
        return self

    async def __aexit__(self, *_: object) -> None:
        for e in EXPERIMENTS:
            if e in self.tail:
                await self.tail[e].aclose()
            if e in self.pub:
                await self.pub[e].aclose()

    async def burst(self, experiment_id: str, groups: list[list[ReadyTrajectory]]) -> float:
        """Publish ``groups`` at once; returns when the burst was acknowledged (perf_counter)."""
        pub = self.pub[experiment_id]
        for g in groups:
            await pub.publish_many(g)
        await pub.flush()
        return time.perf_counter()


async def _declare(cfg: PipelineConfig, args: argparse.Namespace) -> None:
    """What ``experiment add`` does for A and B: their topics, then their registry records."""
    scorer = PRMScorerConfig("tests.scorers.SlowScorer", kwargs={"delay_s": args.delay_ms / 1000})
    for e in EXPERIMENTS:
        await ensure_topics(
            cfg.kafka,
            cfg.topics,
            [trajectories_topic(cfg.topics.trajectories, e), verdicts_topic(cfg.topics.verdicts, e)],
        )
        await publish_spec(
            cfg,
            ExperimentSpec(
                experiment_id=e, prm=PRMConfig(scorers=[scorer]), description=f"bench fleet: experiment {e}"
            ),
        )


async def _warm_up(fleet: _Fleet, partitions: int) -> None:
    """Two records per partition of each experiment, until all have verdicts: every worker
    follows both declarations and the group's assignment covers every partition."""
    for e in EXPERIMENTS:
        warm = _records(e, f"warm-{e}-{uuid.uuid4().hex[:4]}", 2 * partitions)
        await fleet.burst(e, warm)
        await eventually(
            lambda: {g[0].group_id for g in warm} <= fleet.tail[e].arrivals.keys(),
            timeout_s=180,
            what=f"the workers to serve {e}",
        )


async def _peak(fleet: _Fleet, n: int) -> float:
    """Verdicts/s of A alone, flooded with ``n`` records: (n - 1) over first to last verdict
    (the ramp-up before the first verdict is not the fleet's rate)."""
    a = EXPERIMENTS[0]
    groups = _records(a, f"peak-{uuid.uuid4().hex[:4]}", n)
    await fleet.burst(a, groups)
    ids = [g[0].group_id for g in groups]
    await eventually(lambda: set(ids) <= fleet.tail[a].arrivals.keys(), timeout_s=600, what="the peak burst's verdicts")
    times = sorted(fleet.tail[a].arrivals[i] for i in ids)
    return (n - 1) / (times[-1] - times[0])


def _stage_p99(run: dict[str, Any]) -> str:
    """p99 of each stage (bench pipeline's: queue = published -> consumed, score = consumed ->
    scored, a record held for a slot of its experiment included, ...), in ms."""
    return " ".join(f"{k} {_pct(run['stages'][k], 0.99) * 1e3:.0f}" for k in STAGES if k in run["stages"])


async def _b_run(fleet: _Fleet, rate: float, n: int, tag: str) -> dict[str, Any]:
    """B paced at ``rate`` records/s for ``n`` records; its latencies and B's window."""
    b = EXPERIMENTS[1]
    groups = _records(b, f"b-{tag}-{uuid.uuid4().hex[:4]}", n)
    t0 = time.perf_counter()
    run = await _paced(fleet.pub[b], fleet.tail[b], groups, rate)  # type: ignore[arg-type]
    run["window"] = (t0, t0 + n / rate)
    statuses = {
        decode_verdict(fleet.tail[b].raw[g[0].group_id][1], fleet.tail[b].raw[g[0].group_id][2]).status for g in groups
    }  # type: ignore[attr-defined]
    if statuses != {"accepted"}:
        raise RuntimeError(f"B's verdicts were not all accepted: {sorted(statuses)}")
    return run


async def _flooded(fleet: _Fleet, rate: float, n: int, backlog: int, concurrency: int, tag: str) -> dict[str, Any]:
    """A's backlog published at once; once A holds the workers, B as alone; then A drained."""
    a = EXPERIMENTS[0]
    flood = _records(a, f"flood-{tag}-{uuid.uuid4().hex[:4]}", backlog)
    ids = [g[0].group_id for g in flood]
    arrivals = fleet.tail[a].arrivals
    await fleet.burst(a, flood)
    await eventually(
        lambda: sum(i in arrivals for i in ids[: 4 * concurrency]) >= concurrency,
        timeout_s=120,
        what="A's flood to reach the workers",
    )
    run = await _b_run(fleet, rate, n, tag)
    start, end = run["window"]
    await eventually(lambda: set(ids) <= arrivals.keys(), timeout_s=600, what="A's backlog to drain")
    during = sum(1 for i in ids if start <= arrivals[i] <= end)
    run["a_rate"] = during / (end - start)
    run["a_left"] = sum(1 for i in ids if arrivals[i] > end)
    run["a_drained_after_s"] = max(arrivals[i] for i in ids) - end
    return run


async def _fairness(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="prm-bench-fleet-") as tmp, LocalStack(Path(tmp) / "stack") as stack:
        name = uuid.uuid4().hex[:8]
        cfg = _config(stack, name, args)
        await ensure_topics(cfg.kafka, cfg.topics)
        await _declare(cfg, args)  # before the workers start: they read the registry first
        (Path(tmp) / "workers").mkdir()
        workers = WorkerProcesses(
            write_config(cfg, Path(tmp) / "config.yaml"), Path(tmp) / "workers", n=args.workers, cwd=ROOT
        )
        workers.start()
        try:
            async with _Fleet(cfg) as fleet:
                await _warm_up(fleet, cfg.topics.partitions)
                peak = await _peak(fleet, args.peak_records)
                rate = args.share * peak
                n_b = max(10, round(rate * args.seconds))
                backlog = round(args.backlog * n_b)
                print(
                    f"(a) fairness: {args.workers} workers x {args.concurrency} slots, SlowScorer "
                    f"{args.delay_ms:g} ms per record (one-turn, one-member groups); experiments A and B declared, "
                    f"weight 1 each",
                    flush=True,
                )
                print(
                    f"    peak, A alone flooded ({args.peak_records} records): {peak:.1f} verdicts/s "
                    f"(slots / delay: {args.workers * args.concurrency / (args.delay_ms / 1000):.0f}/s; "
                    f"{args.workers * max(1, args.concurrency - 1) / (args.delay_ms / 1000):.0f}/s without the slot "
                    "kept in reserve for the idle experiments, B and default)",
                    flush=True,
                )
                print(
                    f"    B paced at {args.share:.0%} of peak = {rate:.2f}/s for {args.seconds:g} s ({n_b} records); "
                    f"A's backlog {backlog} records ({args.backlog:g}x B's run), published before B starts",
                    flush=True,
                )
                pairs = []
                for k in range(args.pairs):
                    alone = await _b_run(fleet, rate, n_b, f"alone{k}")
                    _print_run(f"pair {k + 1} alone  ", alone)
                    flooded = await _flooded(fleet, rate, n_b, backlog, args.concurrency, f"flood{k}")
                    _print_run(f"pair {k + 1} flooded", flooded)
                    pairs.append((alone, flooded))
                    ratio = _pct(flooded["latencies"], 0.99) / _pct(alone["latencies"], 0.99)
                    print(f"    pair {k + 1}: B p99 flooded / alone = {ratio:.2f}x", flush=True)
        finally:
            workers.stop()
            crashed = workers.unexpected_exits()
            if crashed:
                print(f"    workers that ended by themselves: {crashed}\n{workers.logs()}", file=sys.stderr)
    return {"peak": peak, "rate": rate, "pairs": pairs}


def _print_run(label: str, run: dict[str, Any]) -> None:
    lat = run["latencies"]
    line = (
        f"    {label}: B p50 {_pct(lat, 0.5) * 1e3:5.0f} ms, p99 {_pct(lat, 0.99) * 1e3:5.0f} ms "
        f"(n={len(lat)}; stage p99 ms: {_stage_p99(run)})"
    )
    if "a_rate" in run:
        line += (
            f"; A meanwhile {run['a_rate']:.1f} verdicts/s, {run['a_left']} of its records left at B's end "
            f"(drained {run['a_drained_after_s']:.1f} s later)"
        )
    print(line, flush=True)


def _summary(r: dict[str, Any]) -> None:
    def rng(values: list[float], fmt: str = "{:.0f}") -> str:
        lo, hi = min(values), max(values)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"

    alone = [a for a, _ in r["pairs"]]
    flooded = [f for _, f in r["pairs"]]

    def ms(runs: list[dict[str, Any]], q: float) -> list[float]:
        return [_pct(x["latencies"], q) * 1e3 for x in runs]

    ratios = [_pct(f["latencies"], 0.99) / _pct(a["latencies"], 0.99) for a, f in r["pairs"]]
    print(
        f"    summary over {len(ratios)} pairs (ranges): B alone p50 {rng(ms(alone, 0.5))} ms, p99 "
        f"{rng(ms(alone, 0.99))} ms; B with A flooded p50 {rng(ms(flooded, 0.5))} ms, p99 {rng(ms(flooded, 0.99))} ms"
    )
    print(
        f"    B p99 flooded / alone: {rng(ratios, '{:.2f}')}x (median {statistics.median(ratios):.2f}x; goal <= 2x); "
        f"A meanwhile {rng([f['a_rate'] for f in flooded], '{:.1f}')} verdicts/s "
        f"({rng([f['a_rate'] / r['peak'] for f in flooded], '{:.0%}')} of peak)",
        flush=True,
    )


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.only in (None, "a"):
        _summary(asyncio.run(_fairness(args)))
    pool = ["--sessions", str(args.pool_sessions)]
    if args.only is None:
        bench_pool.main(pool)
    elif args.only in ("b", "c"):
        bench_pool.main([*pool, "--only", args.only])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
