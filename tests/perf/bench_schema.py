"""Benchmark the wire codec on a long trajectory against baselines measured in the same run.

Why packed bytes instead of lists: a 32k-token trajectory as msgpack lists means tens
of thousands of Python ints and floats created on every decode, and float64 on the
wire. Our schema ships int32/float32 little-endian bytes and decodes to zero-copy
numpy views. This script shows what that buys by timing, in one process:

* ``prm schema`` — :func:`infra.schema.encode` / :func:`decode_message` (plus taking the
  numpy views, which is what every consumer does next);
* ``naive lists`` — ``msgspec.msgpack`` of the *same* data as plain Python lists of
  ints/floats (what a schema without packed arrays would do), and the same again with
  the numpy conversion a consumer would need;
* ``memcpy floor`` — copying a ``bytes`` object the size of our payload: no codec can
  beat reading and writing the bytes once.

Absolute microseconds depend on the machine; the ratios are the result. Nothing here
asserts a time: this is a report, not a gate.

Run: ``python -m tests.perf.bench_schema --tokens 32768 --turns 1 --repeats 50``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from infra.schema import Interaction, ModelResponse, ReadyTrajectory, decode_message, encode


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32_768, help="output tokens in total (default 32768)")
    parser.add_argument("--turns", type=int, default=1, help="interactions the tokens are split over (default 1)")
    parser.add_argument("--input-tokens", type=int, default=256, help="prompt tokens per turn (default 256)")
    parser.add_argument("--repeats", type=int, default=30, help="timed samples per case (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls per case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokens <= 0 or args.turns <= 0 or args.repeats <= 0 or args.warmup < 0 or args.input_tokens < 0:
        parser.error("--tokens, --turns and --repeats must be positive; --warmup, --input-tokens >= 0")
    if args.turns > args.tokens:
        parser.error("--turns cannot exceed --tokens")
    return args


def _median_us(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median µs per call; each sample loops enough calls to last >= ~2 ms, so the
    timer's resolution does not dominate microsecond-scale operations."""
    for _ in range(warmup):
        fn()
    inner, elapsed = 1, 0.0
    while True:  # calibrate the inner loop
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= 2e-3 or inner >= 1 << 16:
            break
        inner *= 2
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(samples)


@dataclass
class Row:
    name: str
    encode_us: float
    decode_us: float | None  # None: same decode path as the row above
    wire_bytes: int


def _workload(args: argparse.Namespace) -> tuple[ReadyTrajectory, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    rng = np.random.default_rng(args.seed)
    per_turn = [args.tokens // args.turns + (i < args.tokens % args.turns) for i in range(args.turns)]
    arrays = [
        (
            rng.integers(0, 150_000, args.input_tokens, dtype=np.int32),
            rng.integers(0, 150_000, n, dtype=np.int32),
            -rng.random(n, dtype=np.float32) * 5,
        )
        for n in per_turn
    ]
    return _build(arrays), arrays


def _build(arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> ReadyTrajectory:
    return ReadyTrajectory(
        trajectory_id="bench-t",
        session_id="bench-s",
        group_id="bench-g",
        group_size=8,
        outcome_reward=1.0,
        interactions=[
            Interaction(
                interaction_id=f"i{k}",
                parent_id=f"i{k - 1}" if k else None,
                messages=[{"role": "user", "content": "benchmark"}],
                model_response=ModelResponse.from_arrays(inp, out, lp),
            )
            for k, (inp, out, lp) in enumerate(arrays)
        ],
    )


def _naive(arrays: list[tuple[Any, Any, Any]]) -> dict[str, Any]:
    """The same message as plain builtins, token arrays as Python lists."""
    return {
        "kind": "ready",
        "trajectory_id": "bench-t",
        "session_id": "bench-s",
        "group_id": "bench-g",
        "group_size": 8,
        "outcome_reward": 1.0,
        "interactions": [
            {
                "interaction_id": f"i{k}",
                "parent_id": f"i{k - 1}" if k else None,
                "messages": [{"role": "user", "content": "benchmark"}],
                "model_response": {
                    "input_tokens": inp,
                    "output_tokens": out,
                    "output_logprobs": lp,
                    "stop_reason": "stop",
                },
            }
            for k, (inp, out, lp) in enumerate(arrays)
        ],
    }


def run(args: argparse.Namespace) -> list[Row]:
    msg, arrays = _workload(args)
    rep, warm = args.repeats, args.warmup

    # prm schema: the struct already holds packed bytes (that is how producers build it).
    value, headers = encode(msg)

    def prm_decode() -> None:
        for it in decode_message(value, headers).interactions:
            mr = it.model_response
            mr.input_tokens, mr.output_tokens, mr.output_logprobs  # noqa: B018 - take the views

    rows = [
        Row(
            "prm schema (packed bytes)",
            _median_us(lambda: encode(msg), rep, warm),
            _median_us(prm_decode, rep, warm),
            len(value),
        )
    ]
    rows.append(
        Row("prm schema, build from numpy", _median_us(lambda: encode(_build(arrays)), rep, warm), None, len(value))
    )

    # (a) naive: the same data as plain Python lists through msgspec.msgpack.
    as_lists = [(i.tolist(), o.tolist(), lp.tolist()) for i, o, lp in arrays]
    naive_obj = _naive(as_lists)
    naive_value = msgspec.msgpack.encode(naive_obj)
    decoder = msgspec.msgpack.Decoder()
    rows.append(
        Row(
            "naive msgpack lists",
            _median_us(lambda: msgspec.msgpack.encode(naive_obj), rep, warm),
            _median_us(lambda: decoder.decode(naive_value), rep, warm),
            len(naive_value),
        )
    )

    def naive_numpy_decode() -> None:
        for it in decoder.decode(naive_value)["interactions"]:
            mr = it["model_response"]
            np.asarray(mr["input_tokens"], np.int32), np.asarray(mr["output_tokens"], np.int32)
            np.asarray(mr["output_logprobs"], np.float32)

    rows.append(
        Row(
            "naive lists, from/to numpy",
            _median_us(
                lambda: msgspec.msgpack.encode(_naive([(i.tolist(), o.tolist(), lp.tolist()) for i, o, lp in arrays])),
                rep,
                warm,
            ),
            _median_us(naive_numpy_decode, rep, warm),
            len(naive_value),
        )
    )

    # (b) memcpy floor: copy a bytes object the size of our payload, once per direction.
    src = bytearray(value)
    copy_us = _median_us(lambda: bytes(src), rep, warm)
    rows.append(Row("memcpy floor (bytes copy)", copy_us, copy_us, len(value)))
    return rows


def _table(rows: list[Row], data_bytes: int) -> str:
    def mbps(us: float) -> float:
        return data_bytes / us  # bytes per µs == MB/s

    ours, naive, floor = rows[0], rows[2], rows[-1]
    assert None not in (ours.decode_us, naive.decode_us, floor.decode_us, rows[3].decode_us)
    head = f"{'case':<30} {'enc µs':>10} {'dec µs':>10} {'enc MB/s':>10} {'dec MB/s':>10} {'wire KiB':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        dec_us, dec_mbps = ("(same)", "") if r.decode_us is None else (f"{r.decode_us:.1f}", f"{mbps(r.decode_us):.0f}")
        lines.append(
            f"{r.name:<30} {r.encode_us:>10.1f} {dec_us:>10} {mbps(r.encode_us):>10.0f} "
            f"{dec_mbps:>10} {r.wire_bytes / 1024:>9.1f}"
        )
    lines += [
        "",
        f"prm vs naive lists:     encode {naive.encode_us / ours.encode_us:6.1f}x faster, "
        f"decode {naive.decode_us / ours.decode_us:6.1f}x faster, "
        f"wire {naive.wire_bytes / ours.wire_bytes:4.2f}x smaller",
        f"prm vs naive+numpy:     encode {rows[3].encode_us / rows[1].encode_us:6.1f}x faster, "
        f"decode {rows[3].decode_us / ours.decode_us:6.1f}x faster (both sides start/end at arrays)",
        f"prm vs memcpy floor:    encode {ours.encode_us / floor.encode_us:6.2f}x the floor, "
        f"decode {ours.decode_us / floor.decode_us:6.2f}x the floor",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows = run(args)
    data_bytes = args.turns * args.input_tokens * 4 + args.tokens * 8  # int32 ids + float32 logprobs
    print(
        f"bench_schema: {args.tokens} output tokens over {args.turns} turn(s), {args.input_tokens} prompt "
        f"tokens/turn, {data_bytes / 1024:.0f} KiB of array data; median of {args.repeats}; "
        f"MB/s = array data / time; numpy {np.__version__}, msgspec {msgspec.__version__}"
    )
    print(_table(rows, data_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
