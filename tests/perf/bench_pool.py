"""Benchmark the judge pool: three fake-judge replicas behind one judge scorer.

Sessions of ``--turns`` turns each (a turn's prompt carries the session's earlier turns,
as an agent's does) are scored by :class:`OpenClawJudgeScorer` with fixed ``m = 3``
votes, ``--sessions-in-flight`` sessions at a time, each session's turns one after the
other. The replicas are ``prm-pipeline fake-judge`` child processes.

* **(b) degraded pool** — one replica answers after ``L`` (``--latency-ms``), one after
  ``10 L``, one fails every request (``--error-rate 1``). Reported: the share of calls
  each replica answered (and its attempts, failures included), the p50 / p99 latency of
  a judge call (one vote, failover included), the routes taken, and the votes lost
  (votes that ended in an error; goal 0).
* **(c) session affinity** — three healthy replicas at ``L``: the share of calls that
  went to their session's own replica (rendezvous-preferred; goal >= 0.95 when none is
  overloaded), at the given load and at ``--heavy`` times as many sessions in flight,
  where the replicas' concurrency caps are reached and calls spill.

A report, not a gate. Run: ``prm-pipeline bench pool`` (``--sessions 200 --turns 5
--sessions-in-flight 8 --latency-ms 20``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.schema import Interaction, ModelResponse
from scoring_workers.judge.pool import ROUTES
from scoring_workers.scorers.openclaw import OpenClawJudgeScorer

ROOT = Path(__file__).resolve().parents[2]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench pool", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200, help="sessions per scenario (default 200)")
    parser.add_argument("--turns", type=int, default=5, help="judged turns per session (default 5)")
    parser.add_argument(
        "--sessions-in-flight", type=int, default=8, help="sessions scored at once (default 8: 24 votes in flight)"
    )
    parser.add_argument("--heavy", type=int, default=4, help="(c) also at this many times the sessions in flight")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="healthy replica latency L (default 20)")
    parser.add_argument("--only", choices=("b", "c"), default=None, help="run one scenario only")
    args = parser.parse_args(argv)
    if min(args.sessions, args.turns, args.sessions_in_flight, args.heavy) <= 0 or args.latency_ms <= 0:
        parser.error("every number must be positive")
    return args


@contextmanager
def _replicas(*specs: tuple[str, list[str]]) -> Iterator[list[tuple[str, str]]]:
    """``(name, url)`` of one ``prm-pipeline fake-judge`` process per ``(name, extra args)``."""
    procs: list[subprocess.Popen[str]] = []
    out: list[tuple[str, str]] = []
    try:
        for name, extra in specs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "prm_pipeline.cli", "fake-judge", "--port", "0", *extra],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            procs.append(proc)
            line = proc.stdout.readline() if proc.stdout else ""
            match = re.match(r"PRM_JUDGE_URL=(\S+)", line)
            if match is None:
                raise RuntimeError(f"fake-judge {name} did not start: {line!r}")
            out.append((name, match.group(1)))
        yield out
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


class _TimedScorer(OpenClawJudgeScorer):
    """The judge scorer, recording each judge call's latency and outcome."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.latencies: list[float] = []
        self.lost = 0

    async def _ask(self, messages, deadline, affinity=None):
        t0 = time.perf_counter()
        text, error = await super()._ask(messages, deadline, affinity)
        self.latencies.append(time.perf_counter() - t0)
        self.lost += error is not None
        return text, error


def _session(sid: str, turns: int) -> list[tuple[Interaction, dict]]:
    """One session's turns, each with the conversation so far (its prompt grows)."""
    response = ModelResponse.from_arrays([1, 2, 3], [4, 5, 6, 7])
    messages: list[dict] = [{"role": "user", "content": f"task of {sid}"}]
    items = []
    for t in range(turns):
        output = {"role": "assistant", "content": f"answer {t} of {sid}"}
        state = {"role": "tool", "content": "ok, success" if t % 2 == 0 else "error: try again"}
        turn = Interaction(
            interaction_id=f"{sid}-{t}", messages=list(messages), output_message_list=[output], model_response=response
        )
        after = {"role": "assistant", "content": "next"}
        items.append((turn, {"messages": (*messages, output, state, after), "session_id": sid}))
        messages += [output, state]
    return items


async def _run(urls: list[str], args: argparse.Namespace, in_flight: int, tag: str) -> dict:
    scorer = _TimedScorer(
        base_urls=urls,
        model="fake",
        m=3,
        adaptive=False,
        timeout_s=10,
        total_timeout_s=30,
        max_retries=2,
        backoff_base_s=0.05,
        backoff_max_s=0.5,
    )
    gate = asyncio.Semaphore(in_flight)

    async def session(k: int) -> None:
        async with gate:
            for turn, ctx in _session(f"{tag}-{k}", args.turns):
                await scorer.evaluate_result(turn, ctx)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(k) for k in range(args.sessions)))
        elapsed = time.perf_counter() - t0
        limits = scorer.client.endpoint_limits
        attempts = [lim.attempts for lim in limits]
        answered = [lim.attempts - lim.failed_attempts for lim in limits]
        routes = Counter()
        for lim in limits:
            routes.update(lim.routed)
        breakers = [lim.breaker.opened_count for lim in limits]
    finally:
        await scorer.aclose()
    lat = sorted(scorer.latencies)
    return {
        "votes": len(lat),
        "lost": scorer.lost,
        "elapsed": elapsed,
        "attempts": attempts,
        "answered": answered,
        "routes": routes,
        "breaker_opened": breakers,
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def _routes(routes: Counter) -> str:
    total = sum(routes.values()) or 1
    return ", ".join(f"{r} {routes[r] / total:.3f}" for r in ROUTES if routes[r])


async def _scenario_b(args: argparse.Namespace) -> None:
    lat = args.latency_ms
    specs = [
        ("normal", ["--latency", f"{lat / 1000:g}"]),
        ("slow 10x", ["--latency", f"{10 * lat / 1000:g}"]),
        ("failing", ["--latency", f"{lat / 1000:g}", "--error-rate", "1"]),
    ]
    with _replicas(*specs) as reps:
        r = await _run([u for _, u in reps], args, args.sessions_in_flight, "b")
    total = sum(r["answered"]) or 1
    print(
        f"(b) degraded pool: {r['votes']} votes, {args.sessions_in_flight} sessions in flight, "
        f"L = {lat:g} ms, {r['elapsed']:.1f} s"
    )
    print(f"    {'replica':<10} {'answered':>9} {'share':>7} {'attempts':>9} {'breaker opened':>15}")
    for (name, _), ans, att, opened in zip(reps, r["answered"], r["attempts"], r["breaker_opened"]):
        print(f"    {name:<10} {ans:>9} {ans / total:>7.3f} {att:>9} {opened:>15}")
    print(
        f"    judge call latency p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms; votes lost {r['lost']}; "
        f"routes: {_routes(r['routes'])}"
    )


async def _scenario_c(args: argparse.Namespace) -> None:
    lat = args.latency_ms
    specs = [(f"healthy {i}", ["--latency", f"{lat / 1000:g}"]) for i in range(3)]
    print(
        f"(c) session affinity: three healthy replicas at L = {lat:g} ms, {args.sessions} sessions x "
        f"{args.turns} turns x 3 votes"
    )
    with _replicas(*specs) as reps:
        for in_flight in (args.sessions_in_flight, args.heavy * args.sessions_in_flight):
            r = await _run([u for _, u in reps], args, in_flight, f"c{in_flight}")
            total = sum(r["routes"].values()) or 1
            shares = " / ".join(f"{a / (sum(r['answered']) or 1):.2f}" for a in r["answered"])
            print(
                f"    {in_flight:>3} sessions in flight (~{3 * in_flight} votes): affinity share "
                f"{r['routes']['affinity'] / total:.3f}; replica shares {shares}; p99 {r['p99_ms']:.1f} ms; "
                f"routes: {_routes(r['routes'])}"
            )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.only != "c":
        asyncio.run(_scenario_b(args))
    if args.only != "b":
        asyncio.run(_scenario_c(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
