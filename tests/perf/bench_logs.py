"""Benchmark the escaping log formatter against logging's plain one, measured in the same run.

Every log line of every ``prm-pipeline`` process goes through
:class:`infra.logs.EscapingFormatter` (it escapes the control, line-separator and bidi
characters a record's text may carry). This script times, interleaved round by round:

* ``format`` — ``Formatter.format`` alone, on a worker's verdict line with ordinary ids;
* ``log call`` — the whole ``logger.info(...)`` of that line through a handler writing to
  memory (what the worker pays per line);
* ``hostile`` — ``format`` on a line whose group id holds a newline and an ANSI escape
  (the slow path: the text is rewritten);
* ``traceback`` — ``format`` of a record with an exception and its cause.

Each figure is the median over rounds of the escaping formatter's time divided by the
plain formatter's time in the same round. Absolute microseconds depend on the machine;
the ratios are the result. Nothing here asserts a time: this is a report, not a gate.

Run: ``python -m tests.perf.bench_logs --rounds 30 --lines 5000``.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import sys
import time
from collections.abc import Callable

from infra.logs import FORMAT, EscapingFormatter

VERDICT = "group=%s verdict=%s code=%s reason=%s sessions=%d by=%s"
ORDINARY = ("grp-7f3a9c21-0042", "accepted", "-", "", 4, "w0.1")
HOSTILE = ("grp-7f3a9c21\n2030-01-01 00:00:00,000 ERROR forged\x1b[31m", "accepted", "-", "", 4, "w0.1")


def _record(args: tuple[object, ...], exc_info: object = None) -> logging.LogRecord:
    return logging.LogRecord("scoring_workers.worker", logging.INFO, __file__, 1, VERDICT, args, exc_info)  # type: ignore[arg-type]


def _exc_info() -> object:
    try:
        try:
            raise KeyError("grp-7f3a9c21-0042")
        except KeyError as inner:
            raise ValueError("could not decode the record") from inner
    except ValueError:
        return sys.exc_info()


def _format_loop(formatter: logging.Formatter, record: logging.LogRecord, lines: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(lines):
            record.exc_text = None  # as a fresh record: the traceback is formatted each time
            formatter.format(record)

    return run


def _log_loop(formatter: logging.Formatter, lines: int) -> Callable[[], None]:
    logger = logging.getLogger(f"bench_logs.{type(formatter).__name__}")
    logger.propagate, logger.level = False, logging.INFO
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(formatter)
    logger.handlers = [handler]

    def run() -> None:
        stream = handler.stream
        stream.seek(0)
        stream.truncate()
        for _ in range(lines):
            logger.info(VERDICT, *ORDINARY)

    return run


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    parser.add_argument("--lines", type=int, default=5000, help="lines formatted per round and case (default 5000)")
    args = parser.parse_args(argv)
    plain, escaping = logging.Formatter(FORMAT), EscapingFormatter(FORMAT)
    traceback_lines = max(1, args.lines // 20)
    cases = {
        "format": lambda f: _format_loop(f, _record(ORDINARY), args.lines),
        "log call": lambda f: _log_loop(f, args.lines),
        "hostile": lambda f: _format_loop(f, _record(HOSTILE), args.lines),
        "traceback": lambda f: _format_loop(f, _record(ORDINARY, _exc_info()), traceback_lines),
    }
    per_line = {name: traceback_lines if name == "traceback" else args.lines for name in cases}
    runs = {name: (make(plain), make(escaping)) for name, make in cases.items()}
    ratios: dict[str, list[float]] = {name: [] for name in cases}
    base: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(args.rounds):
        for name, (ours_first, other) in runs.items():
            pair = (other, ours_first) if i % 2 else (ours_first, other)  # alternate which goes first
            times = {id(fn): _timed(fn) for fn in pair}
            p, e = times[id(runs[name][0])], times[id(runs[name][1])]
            ratios[name].append(e / p)
            base[name].append(p / per_line[name] * 1e6)
    print(
        f"bench_logs: {args.rounds} interleaved rounds, {args.lines} lines per round "
        f"({traceback_lines} for the traceback case), Python {sys.version.split()[0]}"
    )
    print(f"{'case':<10} {'plain us/line':>14} {'escaping / plain':>17} {'spread (p10-p90)':>18}")
    for name in cases:
        qs = statistics.quantiles(ratios[name], n=10)
        print(
            f"{name:<10} {statistics.median(base[name]):>14.2f} {statistics.median(ratios[name]):>17.2f}x "
            f"{qs[0]:>8.2f}-{qs[-1]:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
