"""Memory-bandwidth report for ``shaper.shape_advantages`` (ready for a GPU run; runs on CPU too).

Shaping is elementwise, so its speed limit is memory bandwidth: each call reads
``A`` and ``P`` (4 bytes per element each in float32), the mask (1 byte as bool)
and writes the output (4 bytes). This script times every mode, fused and eager,
on the chosen device and reports the achieved bandwidth (those bytes / median
time) as a fraction of two references measured in the same run on the same
device: a plain ``copy_`` of the same size (read + write: what the memory system
delivers in practice) and, when known or given with ``--peak-gbs``, the device's
nominal peak.

Run: ``python -m tests.perf.gpu_shaping`` (CUDA when available, else CPU) or
``python -m tests.perf.gpu_shaping --device cpu --rows 512 --cols 8192``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from shaper.shaping import SHAPING_MODES, shape_advantages
from tests.perf.bench_shaping import with_compile

# Nominal peak memory bandwidth (GB/s = 1e9 B/s) of devices we expect to meet.
NOMINAL_GBS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100": 3350.0, "A100-SXM4-80GB": 2039.0, "A100": 1555.0}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="rows B (default 4096 on CUDA, 512 on CPU)")
    parser.add_argument("--cols", type=int, default=8192, help="tokens per row T (default 8192)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--peak-gbs", type=float, default=None, help="nominal peak bandwidth in GB/s")
    return parser.parse_args(argv)


def _timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    def median_s(fn: Callable[[], object], warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        samples = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return median_s


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda requested but CUDA is not available")
        device = torch.device(args.device)
    rows = args.rows or (4096 if device.type == "cuda" else 512)
    shape = (rows, args.cols)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(shape, generator=gen).to(device)
    signed = torch.randn(shape, generator=gen).to(device)
    unit = torch.rand(shape, generator=gen).to(device)
    mask = (torch.rand(shape, generator=gen) < 0.9).to(device)
    n = a.numel()
    median_s = _timer(device)

    dst = torch.empty_like(a)
    copy_gbs = 2 * 4 * n / median_s(lambda: dst.copy_(a), args.warmup, args.repeats) / 1e9
    add_gbs = 3 * 4 * n / median_s(lambda: a + signed, args.warmup, args.repeats) / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_gbs
    if peak is None:
        peak = next((v for k, v in NOMINAL_GBS.items() if k in name), None)
    print(f"device={name} shape={list(shape)} float32, median of {args.repeats}")
    print(
        f"copy_ (read+write): {copy_gbs:8.1f} GB/s"
        + (f"  = {copy_gbs / peak:.2f} of nominal {peak:.0f} GB/s" if peak else "")
    )
    print(f"A + P  (floor)    : {add_gbs:8.1f} GB/s  = {add_gbs / copy_gbs:.2f} of copy_")
    bytes_moved = (4 + 4 + 1 + 4) * n  # A, P, bool mask in; shaped A out
    print(f"{'mode':<24} {'ms':>8} {'GB/s':>8} {'of copy_':>9}" + (f" {'of peak':>8}" if peak else ""))
    for mode in SHAPING_MODES:
        p = unit if mode == "process_weighted" else signed
        call = functools.partial(shape_advantages, a, p, mask, mode=mode)
        for label, enabled in (("eager", False), ("fused", True)):
            seconds = median_s(with_compile(call, enabled), args.warmup, args.repeats)
            gbs = bytes_moved / seconds / 1e9
            line = f"{mode + ' ' + label:<24} {seconds * 1e3:8.3f} {gbs:8.1f} {gbs / copy_gbs:9.2f}"
            print(line + (f" {gbs / peak:8.2f}" if peak else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
