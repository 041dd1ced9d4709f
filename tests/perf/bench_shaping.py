"""Benchmark ``shaper.shape_advantages`` against a memory-bound floor.

Every shaping mode is elementwise, so the cheapest conceivable implementation
reads the inputs once and writes the output once.  A single ``A + P`` on the
same tensors is that floor (``where(mask, A, P)`` adds the mask's bytes); printing each mode's median time as a *ratio* to
it, measured in the same run on the same device, makes results comparable
across machines where absolute milliseconds are not.  Nothing here asserts a
time: this is a report, not a gate.

Each mode is timed twice in the same run: ``fused`` is what ``shape_advantages``
does (one compiled pass per mode on large inputs), ``eager`` the same expression
with compilation off (``PRM_SHAPING_COMPILE=0``), i.e. one pass per operator.
Before timing, the two are checked to give identical results.

Run: ``prm-pipeline bench shaping`` or
``python -m tests.perf.bench_shaping --rows 512 --cols 8192 --repeats 20``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from shaper.shaping import SHAPING_MODES, shape_advantages


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="batch rows B (default 512)")
    parser.add_argument("--cols", type=int, default=8192, help="tokens per row T (default 8192)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per case (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up calls per case")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rows <= 0 or args.cols <= 0 or args.repeats <= 0 or args.warmup < 0:
        parser.error("--rows, --cols and --repeats must be positive, --warmup non-negative")
    return args


def _device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    return torch.device(choice)


def _median_ms(
    cases: dict[str, Callable[[], object]], device: torch.device, warmup: int, repeats: int
) -> dict[str, float]:
    """Median wall time per case, in ms.

    Cases are timed round-robin (one call of each per round) rather than one
    case after another, so slow drift on a shared machine hits every case
    alike and the ratios stay meaningful.
    """

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in cases.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def with_compile(call: Callable[[], torch.Tensor], enabled: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        os.environ["PRM_SHAPING_COMPILE"] = "1" if enabled else "0"
        return call()

    return run


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = _device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (args.rows, args.cols)

    advantages = torch.randn(shape, generator=gen).to(device)
    signed_rewards = torch.randn(shape, generator=gen).to(device)  # additive / gvpo: any sign
    unit_rewards = torch.rand(shape, generator=gen).to(device)  # process_weighted: [0, 1]
    loss_mask = (torch.rand(shape, generator=gen) < 0.9).to(device)  # ~10% padding/prompt

    floor = "A + P (floor)"
    cases: dict[str, Callable[[], object]] = {
        floor: lambda: advantages + signed_rewards,
        # One ATen op with shaping's memory traffic (two floats and the bool mask in,
        # one float out): what any masked mode costs at the very least.
        "where(mask, A, P)": lambda: torch.where(loss_mask, advantages, signed_rewards),
    }
    for mode in SHAPING_MODES:
        rewards = unit_rewards if mode == "process_weighted" else signed_rewards
        call = functools.partial(shape_advantages, advantages, rewards, loss_mask, mode=mode)
        eager, fused = with_compile(call, False), with_compile(call, True)
        a, b = eager(), fused()
        if not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())):
            raise SystemExit(f"mode {mode!r}: fused and eager results differ")
        cases[f"{mode} eager"] = eager
        cases[f"{mode} fused"] = fused
    medians = _median_ms(cases, device, args.warmup, args.repeats)
    floor_ms = medians[floor]

    mib = advantages.numel() * advantages.element_size() / 2**20
    print(
        f"shape_advantages on [{args.rows}, {args.cols}] float32 ({mib:.0f} MiB per tensor), "
        f"device={device}, threads={torch.get_num_threads()}, "
        f"median of {args.repeats} (warm-up {args.warmup})"
    )
    print(f"{'mode':<24} {'median ms':>10} {'x A+P':>7}")
    for name, ms in medians.items():
        print(f"{name:<24} {ms:>10.3f} {ms / floor_ms:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
