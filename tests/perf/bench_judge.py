"""Benchmark the OpenClaw judge scorer against the fake judge: throughput and calls/turn.

A :class:`~prm_pipeline.demo.fake_judge.FakeJudgeServer` answers every request
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
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from infra.schema import Interaction, ModelResponse
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.settings import ClientSettings
from scoring_workers.scorers.openclaw import OpenClawJudgeScorer

LABELS = (1, 0, -1)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=300, help="turns scored per mode (default 300)")
    parser.add_argument("--concurrency", type=int, default=16, help="turns in flight C (default 16)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="fake judge latency (default 50)")
    parser.add_argument(
        "--agreement", type=float, default=0.8, help="probability that a vote equals the turn's label (default 0.8)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--calls", type=int, default=4000, help="judge calls per run of the client calls/s section (default 4000)"
    )
    parser.add_argument(
        "--call-concurrency",
        type=int,
        default=128,
        help="judge calls in flight in the client calls/s section (default 128)",
    )
    parser.add_argument("--only", choices=("turns", "calls"), default=None, help="run one section only")
    parser.add_argument("--in-process", action="store_true", help="run the fake judge in a thread of this process")
    args = parser.parse_args(argv)
    if (
        min(args.turns, args.concurrency, args.repeats, args.calls, args.call_concurrency) <= 0
        or args.latency_ms <= 0
        or not 0 <= args.agreement <= 1
    ):
        parser.error(
            "--turns, --concurrency, --repeats, --calls, --call-concurrency and --latency-ms must be positive, "
            "--agreement in [0, 1]"
        )
    return args


def _workload(n: int, agreement: float, seed: int, prefix: str = "t") -> list[tuple[Interaction, dict]]:
    rng = random.Random(seed)
    items = []
    response = ModelResponse.from_arrays([1, 2, 3], [4, 5, 6, 7])
    for i in range(n):
        label = rng.choice(LABELS)
        votes = [label if rng.random() < agreement else rng.choice([v for v in LABELS if v != label]) for _ in range(3)]
        user = {"role": "user", "content": f"task {prefix}{i}"}
        output = {"role": "assistant", "content": f"answer {prefix}{i}"}
        feedback = {"role": "user", "content": f"feedback {prefix}{i} [[votes: {', '.join(map(str, votes))}]]"}
        turn = Interaction(
            interaction_id=f"{prefix}{i}", messages=[user], output_message_list=[output], model_response=response
        )
        after = {"role": "assistant", "content": f"next answer {prefix}{i}"}  # the next turn: feedback is its state
        items.append((turn, {"messages": (user, output, feedback, after)}))
    return items


async def _run_mode(url: str, items, warm, concurrency: int, *, adaptive: bool, judge_cap: int) -> tuple[float, float]:
    scorer = OpenClawJudgeScorer(
        base_url=url, model="fake", adaptive=adaptive, max_concurrency=judge_cap, timeout_s=30, total_timeout_s=60
    )
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
    with _judge_process(latency_ms, in_process) as (url, _pid):
        yield url


@contextlib.contextmanager
def _judge_process(latency_ms: float, in_process: bool) -> Iterator[tuple[str, int | None]]:
    """The fake judge's URL and the pid of its process (``None`` in-process)."""
    if in_process:
        with FakeJudgeServer(latency_ms=latency_ms) as server:
            yield server.base_url, None
        return
    proc = subprocess.Popen(
        [sys.executable, "-m", "prm_pipeline.demo.fake_judge", "--port", "0", "--latency", f"{latency_ms / 1000.0:g}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("PRM_JUDGE_URL="):
            raise RuntimeError(f"fake judge did not start: {line!r}")
        yield line.strip().split("=", 1)[1], proc.pid
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
                    runs.append(await _run_mode(url, items, warm, args.concurrency, adaptive=adaptive, judge_cap=cap))
                tps = statistics.median(r[0] for r in runs)
                calls = statistics.median(r[1] for r in runs)
                rows.append((name, tps, tps / ideal, calls))
    return rows


# --------------------------------------------------------------------------- client calls/s
_CALL_PAYLOAD = {
    "model": "fake",
    "messages": [
        {"role": "system", "content": "You judge."},
        {"role": "user", "content": "## Next state [role: user]\nthanks, that worked"},
    ],
    "temperature": 0.6,
    "max_tokens": 64,
    "stream": False,
}


async def _raw_calls(url: str, concurrency: int, calls: int) -> tuple[float, float]:
    """The baseline: ``concurrency`` keep-alive connections driven by bare asyncio streams
    (no HTTP library, no JSON decoding of the answer) — what the server allows at most.
    Returns ``(calls/s, client CPU seconds per call)``, as :func:`_client_calls`."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(_CALL_PAYLOAD).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    left = [calls]

    async def conn() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while left[0] > 0:
                left[0] -= 1
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":", 1)[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                await reader.readexactly(length)
        finally:
            writer.close()

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(conn() for _ in range(concurrency)))
    return calls / (time.perf_counter() - start), (time.process_time() - cpu) / calls


async def _client_calls(url: str, concurrency: int, calls: int) -> tuple[float, float]:
    """``concurrency`` loops of :meth:`JudgeClient.post_json` (the worker's code path)."""
    settings = ClientSettings.from_flat({"max_concurrency": concurrency, "timeout_s": 30, "total_timeout_s": 60})
    async with JudgeClient(url, settings) as client:
        left = [concurrency]

        async def loop(n: int) -> None:
            for _ in range(n):
                data = await client.post_json("/v1/chat/completions", _CALL_PAYLOAD)
                assert data["choices"][0]["message"]["content"]

        await asyncio.gather(*(loop(1) for _ in range(left[0])))  # open the connections first
        per = [calls // concurrency + (1 if i < calls % concurrency else 0) for i in range(concurrency)]
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(loop(n) for n in per))
        return calls / (time.perf_counter() - start), (time.process_time() - cpu) / calls


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``); 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _bench_calls(args: argparse.Namespace) -> list[dict[str, float]]:
    """Per run: calls/s and CPU per call of the raw baseline and of the client, measured
    back to back against one judge, plus the judge server's own CPU per call."""
    runs = []
    with _judge_process(args.latency_ms, args.in_process) as (url, pid):
        await _raw_calls(url, args.call_concurrency, args.call_concurrency)  # warm the server's threads
        for _ in range(args.repeats):
            server_cpu = _cpu_seconds(pid)
            raw, raw_cpu = await _raw_calls(url, args.call_concurrency, args.calls)
            between = _cpu_seconds(pid)
            client, client_cpu = await _client_calls(url, args.call_concurrency, args.calls)
            runs.append(
                {
                    "raw": raw,
                    "raw_cpu": raw_cpu,
                    "client": client,
                    "client_cpu": client_cpu,
                    "server_cpu": (between - server_cpu) / args.calls,
                    "server_cpu_client": (_cpu_seconds(pid) - between) / args.calls,
                }
            )
    return runs


def _report_calls(args: argparse.Namespace, runs: list[dict[str, float]]) -> None:
    ideal = args.call_concurrency / (args.latency_ms / 1000.0)
    print(
        f"\njudge client: {args.calls} calls x {args.repeats} runs, C = {args.call_concurrency} calls in flight, "
        f"judge latency {args.latency_ms:g} ms; ideal C/latency = {ideal:.0f} calls/s; ranges over runs"
    )
    print(
        f"{'path':<22} {'calls/s':>11} {'/ideal':>11} {'/raw':>11} {'client CPU/call':>16} {'CPU /raw':>11} "
        f"{'1 core allows':>15} {'judge CPU/call':>15}"
    )

    def span(key: str, fmt: str, scale: float = 1.0, invert: bool = False) -> str:
        values = [(scale / r[key] if r[key] else float("inf")) if invert else r[key] * scale for r in runs]
        return f"{format(min(values), fmt)}..{format(max(values), fmt)}"

    for name, key, server_key in (
        ("raw asyncio streams", "raw", "server_cpu"),
        ("JudgeClient.post_json", "client", "server_cpu_client"),
    ):
        for r in runs:  # per run: the client against the raw baseline measured just before it
            r["ratio"] = r["client"] / r["raw"]
            r["cpu_ratio"] = r["client_cpu"] / r["raw_cpu"] if r["raw_cpu"] else float("inf")
        ratio = "1" if key == "raw" else span("ratio", ".2f")
        cpu_ratio = "1" if key == "raw" else span("cpu_ratio", ".2f")
        print(
            f"{name:<22} {span(key, '.0f'):>11} {span(key, '.2f', 1 / ideal):>11} {ratio:>11} "
            f"{span(key + '_cpu', '.0f', 1e6) + ' us':>16} {cpu_ratio:>11} "
            f"{span(key + '_cpu', '.0f', 1.0, invert=True):>15} {span(server_key, '.0f', 1e6) + ' us':>15}"
        )
    print(
        "(CPU /raw = the client's CPU per call over the raw baseline's, per run; 1 core allows = calls/s the "
        "client process could make if it had a whole core; the judge server runs in its own process, whose CPU "
        "per call bounds the raw baseline on a shared machine)"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.only != "turns":
        _report_calls(args, asyncio.run(_bench_calls(args)))
    if args.only == "calls":
        return 0
    rows = asyncio.run(_bench(args))
    ideal = args.concurrency / (args.latency_ms / 1000.0)
    print(
        f"judge latency {args.latency_ms:g} ms, C = {args.concurrency} turns in flight, "
        f"{args.turns} turns x {args.repeats} runs (median), vote agreement {args.agreement:g}, "
        f"ideal C/latency = {ideal:.1f} turns/s"
    )
    print(f"{'mode':<28} {'turns/s':>9} {'/ideal':>7} {'calls/turn':>11}")
    for name, tps, ratio, calls in rows:
        print(f"{name:<28} {tps:9.1f} {ratio:7.2f} {calls:11.2f}")
    fixed_calls, adaptive_calls = rows[0][3], rows[1][3]
    print(f"adaptive voting saves {1 - adaptive_calls / fixed_calls:.0%} of judge calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
