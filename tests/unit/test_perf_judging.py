"""The soak benchmark's verdicts on its series: flat is bounded, a leak is not (pure logic)."""

from __future__ import annotations

import math

from tests.perf.bench_soak import _judge
from tests.perf.procstats import percentile, read_proc, slope

MIB = 1048576.0


def test_slope_is_least_squares() -> None:
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == 2.0
    assert slope([0], [5]) == 0.0 and slope([1, 1], [2, 3]) == 0.0


def test_percentile_nearest_rank() -> None:
    assert percentile([3, 1, 2], 0.5) == 2 and percentile(list(range(100)), 0.99) == 99
    assert math.isnan(percentile([], 0.5))


def test_flat_memory_after_warm_up_is_bounded() -> None:
    ts = [60.0 * i for i in range(32)]  # 31 minutes
    ys = [200 * MIB + (40 * MIB if i > 2 else 0) + (i % 3) * MIB for i in range(32)]  # warm-up step, then noise
    assert _judge("worker0 RSS", ts, ys, 16)[2] == "bounded"


def test_a_steady_leak_is_caught() -> None:
    ts = [60.0 * i for i in range(32)]
    ys = [200 * MIB + 2 * MIB * i for i in range(32)]  # 120 MiB/h on 250 MiB: unbounded
    assert _judge("worker0 RSS", ts, ys, 16)[2].startswith("GROWS")


def test_a_short_run_only_catches_gross_growth() -> None:
    ts = [10.0 * i for i in range(18)]  # 3 minutes: per-hour slopes are not judged
    slow = [200 * MIB + 0.5 * MIB * i for i in range(18)]
    fast = [200 * MIB + 20 * MIB * i for i in range(18)]
    assert _judge("trainer RSS", ts, slow, 9)[2] == "bounded"
    assert _judge("trainer RSS", ts, fast, 9)[2].startswith("GROWS")


def test_read_proc_of_this_process() -> None:
    import os
    import time

    r = read_proc(os.getpid())
    assert r is not None and r.cpu_s > 0 and r.rss_bytes > 10 * MIB
    for _ in range(3):
        time.sleep(0.001)  # each sleep blocks the thread once: a voluntary context switch
    later = read_proc(os.getpid())
    assert later is not None and later.wakeups >= r.wakeups + 3
    assert read_proc(2**22 + 12345) is None
