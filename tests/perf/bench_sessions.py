"""Long agent sessions: worker CPU and peak memory per 1,000 content tokens, 8 to 100 turns.

A session's wire record used to grow with the square of its turns (every turn carried
the whole conversation and prompt). In the compact form (docs/wire.md) a record carries
each token and message once, and chunk records carry sessions over the record limit.
This benchmark checks that the *worker's* cost is linear too: for sessions of
``--turns`` turns (default 8, 40, 100) at ``--tokens-per-turn`` context tokens per turn
(default 1,280: 100 turns = a 128k context) it runs the worker's path on the records a
:class:`~producers.publisher.TrajectoryPublisher` would send — decode (reassembling
chunks), expand, score with ``PRMRunner`` (``LengthBudgetScorer`` plus a scorer that
reads every turn's full prompt and conversation), build the verdict's token turns — and
reports CPU time (best of ``--repeats``) and the peak of traced allocations (the fetched
record values included), each per 1,000 content tokens (unique prompt + output tokens). Goal: flat within 1.5x from the
smallest to the largest session. Figures are reported, never asserted.

Run: ``prm-pipeline bench sessions`` (``-- --turns 8 40 100 --repeats 3``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import tracemalloc
from typing import Any

import numpy as np

from infra.chunks import ChunkAssembler, reassembled, to_records
from infra.schema import ReadyTrajectory, TrajectoryChunk, decode_message, encode
from prm_pipeline.demo.synthetic import make_agent_session, session_content_bytes
from scoring_workers.prm import PRMConfig, PRMRunner
from scoring_workers.scorers import LengthBudgetScorer
from scoring_workers.scoring import score_member
from tests.scorers import TokenEchoScorer

LIMIT = 1_048_576  # kafka.max_message_bytes, the default


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 40, 100], help="session lengths (default 8 40 100)")
    parser.add_argument("--tokens-per-turn", type=int, default=1280, help="context tokens per turn (default 1280)")
    parser.add_argument("--output-tokens", type=int, default=200, help="output tokens per turn (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the best is reported (default 3)")
    args = parser.parse_args(argv)
    if min(*args.turns, args.tokens_per_turn, args.repeats) <= 0 or args.output_tokens >= args.tokens_per_turn:
        parser.error("--turns, --tokens-per-turn and --repeats must be positive; --output-tokens < --tokens-per-turn")
    return args


async def _worker_path(runner: PRMRunner, records: list[tuple[bytes, list[tuple[str, bytes]]]]) -> Any:
    """What a worker does with one session's records, up to the result it parks."""
    records = [(bytes(memoryview(v)), h) for v, h in records]  # fetched: the consumer allocates the values
    assembler: ChunkAssembler[int] = ChunkAssembler()
    traj: Any = None
    for offset, (value, headers) in enumerate(records):
        message = decode_message(value, headers)
        if isinstance(message, TrajectoryChunk):
            traj = next((reassembled(done) for done in assembler.add(0, message, offset)), traj)
        else:
            traj = message
        del message
    assert isinstance(traj, ReadyTrajectory)
    result = await score_member(runner, traj, timeout_s=None)
    assert result.status == "scored", result.error
    return result


def _content_tokens(traj: ReadyTrajectory) -> int:
    from infra.schema import compact_trajectory

    return sum(
        i.model_response.input_len + i.model_response.output_len
        for i in compact_trajectory(traj).interactions
        if i.model_response is not None
    )


async def _bench(args: argparse.Namespace) -> list[dict[str, float]]:
    runner = await PRMRunner.create(
        PRMConfig(
            scorers=[
                LengthBudgetScorer(max_output_tokens=4096),  # type: ignore[list-item]
                TokenEchoScorer(),
            ]
        )
    )
    rows = []
    try:
        for turns in args.turns:
            traj = make_agent_session(
                trajectory_id=f"t{turns}",
                session_id=f"s{turns}",
                group_id=f"g{turns}",
                turns=turns,
                context_tokens=turns * args.tokens_per_turn,
                output_tokens=args.output_tokens,
                rng=np.random.default_rng(turns),
            )
            records = to_records(traj, LIMIT)
            tokens = _content_tokens(traj)
            await _worker_path(runner, records)  # warm-up
            cpu = []
            for _ in range(args.repeats):
                t0 = time.process_time()
                await _worker_path(runner, records)
                cpu.append(time.process_time() - t0)
            tracemalloc.start()
            await _worker_path(runner, records)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            rows.append(
                {
                    "turns": turns,
                    "content_tokens": tokens,
                    "content_bytes": session_content_bytes(traj),
                    "records": len(records),
                    "wire_bytes": sum(len(v) for v, _ in records),
                    "full_bytes": len(encode(traj)[0]),
                    "cpu_ms": min(cpu) * 1000,
                    "peak_mb": peak / 1e6,
                }
            )
    finally:
        await runner.aclose()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows = asyncio.run(_bench(args))
    print(
        f"bench_sessions: agent sessions, {args.tokens_per_turn} context tokens/turn ({args.output_tokens} output), "
        f"worker path best of {args.repeats}; record limit {LIMIT} bytes"
    )
    header = (
        f"{'turns':>6}{'content tok':>12}{'records':>8}{'wire MB':>9}{'x content':>10}{'full form MB':>13}"
        f"{'CPU ms':>9}{'CPU ms/1k tok':>14}{'peak MB':>9}{'peak KB/1k tok':>15}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        k = r["content_tokens"] / 1000
        print(
            f"{r['turns']:>6}{r['content_tokens']:>12}{r['records']:>8}{r['wire_bytes'] / 1e6:>9.3f}"
            f"{r['wire_bytes'] / r['content_bytes']:>10.3f}{r['full_bytes'] / 1e6:>13.2f}{r['cpu_ms']:>9.1f}"
            f"{r['cpu_ms'] / k:>14.3f}{r['peak_mb']:>9.2f}{r['peak_mb'] * 1000 / k:>15.1f}"
        )
    cpu = [r["cpu_ms"] / r["content_tokens"] for r in rows]
    mem = [r["peak_mb"] / r["content_tokens"] for r in rows]
    print(
        f"spread (max/min per 1k content tokens): CPU {max(cpu) / min(cpu):.2f}x, peak memory {max(mem) / min(mem):.2f}x "
        "(goal: within 1.5x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
