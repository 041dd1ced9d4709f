"""Benchmark the OpenClaw judge scorer against the fake judge: throughput and calls/turn.

A :class:`~scoring_workers.scorers.fake_judge.FakeJudgeServer` answers every request
after ``--latency-ms`` (default 50 ms). ``--turns`` turns are scored with at most
``--concurrency`` C turns in flight, once with OpenClaw-RL's fixed ``m = 3`` votes and
once with adaptive voting. Each turn's three votes are scripted: each vote equals the
turn's "true" label with probability ``--agreement`` and is another label otherwise,
so the judge disagrees with itself about as often as a sampled LLM judge would.

Reported per mode:

* ``turns/s`` and its ratio to the ideal ``C / latency`` — every turn needs at least
  one judge round trip, so C turns in flight cannot finish faster. Fixed voting asks
  its 3 votes in one parallel round; adaptive voting asks 2 and, when they disagree,
  a third in a second round, so its latency per turn is higher while the judge
  does less work.
* ``calls/turn`` — judge requests per turn (3 for fixed voting).
* ``judge-bound turns/s`` — the same run with the judge's shared concurrency cap set
  to C requests (the judge, not the turn pipeline, is the bottleneck): here fewer
  calls mean more turns per second.

The fake judge runs in a child process (``--in-process`` keeps it in a thread of
this process, where it competes with the client for the GIL).

This is a report, not a gate: nothing is asserted. Run:
``python -m tests.perf.bench_judge --turns 300 --concurrency 16 --latency-ms 50``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from infra.schema import Interaction, ModelResponse
from scoring_workers.scorers.fake_judge import FakeJudgeServer
from scoring_workers.scorers.openclaw import OpenClawJudgeScorer

LABELS = (1, 0, -1)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=300, help="turns scored per mode (default 300)")
    parser.add_argument("--concurrency", type=int, default=16, help="turns in flight C (default 16)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="fake judge latency (default 50)")
    parser.add_argument("--agreement", type=float, default=0.8,
                        help="probability that a vote equals the turn's label (default 0.8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-size", type=int, default=8, help="connections per httpx client (default 8)")
    parser.add_argument("--in-process", action="store_true", help="run the fake judge in a thread of this process")
    args = parser.parse_args(argv)
    if min(args.turns, args.concurrency, args.repeats, args.pool_size) <= 0 or args.latency_ms <= 0 \
            or not 0 <= args.agreement <= 1:
        parser.error("--turns, --concurrency, --repeats, --pool-size and --latency-ms must be positive, "
                     "--agreement in [0, 1]")
    return args


def _workload(n: int, agreement: float, seed: int, prefix: str = "t") -> list[tuple[Interaction, dict]]:
    rng = random.Random(seed)
    items = []
    response = ModelResponse.from_arrays([1, 2, 3], [4, 5, 6, 7])
    for i in range(n):
        label = rng.choice(LABELS)
        votes = [label if rng.random() < agreement else rng.choice([v for v in LABELS if v != label])
                 for _ in range(3)]
        user = {"role": "user", "content": f"task {prefix}{i}"}
        output = {"role": "assistant", "content": f"answer {prefix}{i}"}
        feedback = {"role": "user", "content": f"feedback {prefix}{i} [[votes: {', '.join(map(str, votes))}]]"}
        turn = Interaction(interaction_id=f"{prefix}{i}", messages=[user], output_message_list=[output],
                           model_response=response)
        items.append((turn, {"messages": (user, output, feedback)}))
    return items


async def _run_mode(url: str, items, warm, concurrency: int, *, adaptive: bool, judge_cap: int,
                    pool_size: int) -> tuple[float, float]:
    scorer = OpenClawJudgeScorer(base_url=url, model="fake", adaptive=adaptive, max_concurrency=judge_cap,
                                 timeout_s=30, total_timeout_s=60, pool_size=pool_size)
    gate = asyncio.Semaphore(concurrency)

    async def one(turn, ctx) -> None:
        async with gate:
            await scorer.evaluate_result(turn, ctx)

    try:
        await asyncio.gather(*(one(t, c) for t, c in warm))  # open connections first
        calls_before = scorer.counters["judge_calls"]
        start = time.perf_counter()
        await asyncio.gather(*(one(t, c) for t, c in items))
        elapsed = time.perf_counter() - start
        calls = scorer.counters["judge_calls"] - calls_before
    finally:
        await scorer.aclose()
    return len(items) / elapsed, calls / len(items)


@contextlib.contextmanager
def _judge(latency_ms: float, in_process: bool) -> Iterator[str]:
    if in_process:
        with FakeJudgeServer(latency_ms=latency_ms) as server:
            yield server.base_url
        return
    proc = subprocess.Popen(
        [sys.executable, "-m", "scoring_workers.scorers.fake_judge", "--port", "0", "--latency-ms", str(latency_ms)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("PRM_JUDGE_URL="):
            raise RuntimeError(f"fake judge did not start: {line!r}")
        yield line.strip().split("=", 1)[1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def _bench(args: argparse.Namespace) -> list[tuple[str, float, float, float]]:
    latency = args.latency_ms / 1000.0
    ideal = args.concurrency / latency
    rows = []
    with _judge(args.latency_ms, args.in_process) as url:
        for judge_bound in (False, True):
            cap = args.concurrency if judge_bound else 3 * args.concurrency
            for adaptive in (False, True):
                name = ("adaptive" if adaptive else "fixed m=3") + (" (judge cap C)" if judge_bound else "")
                runs = []
                for rep in range(args.repeats):
                    # Unique prompts per run: the judge's scripted-vote counters start at zero.
                    tag = f"{int(judge_bound)}{int(adaptive)}-{rep}-"
                    items = _workload(args.turns, args.agreement, args.seed, prefix=tag)
                    warm = _workload(args.concurrency, args.agreement, args.seed + 1, prefix="warm" + tag)
                    runs.append(await _run_mode(url, items, warm, args.concurrency, adaptive=adaptive,
                                                judge_cap=cap, pool_size=args.pool_size))
                tps = statistics.median(r[0] for r in runs)
                calls = statistics.median(r[1] for r in runs)
                rows.append((name, tps, tps / ideal, calls))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows = asyncio.run(_bench(args))
    ideal = args.concurrency / (args.latency_ms / 1000.0)
    print(f"judge latency {args.latency_ms:g} ms, C = {args.concurrency} turns in flight, "
          f"{args.turns} turns x {args.repeats} runs (median), vote agreement {args.agreement:g}, "
          f"pool size {args.pool_size}; ideal C/latency = {ideal:.1f} turns/s")
    print(f"{'mode':<28} {'turns/s':>9} {'/ideal':>7} {'calls/turn':>11}")
    for name, tps, ratio, calls in rows:
        print(f"{name:<28} {tps:9.1f} {ratio:7.2f} {calls:11.2f}")
    fixed_calls, adaptive_calls = rows[0][3], rows[1][3]
    print(f"adaptive voting saves {1 - adaptive_calls / fixed_calls:.0%} of judge calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
