"""Where a worker's CPU goes: one in-process worker under pyinstrument on the embedded stack.

    python -m tests.perf.profile_worker --groups 500 [--verdict-tokens reference] [--html out.html]

Publishes ``--groups`` groups of ``bench pipeline``'s workload (4 sessions, 8 turns,
256–512 output tokens, ``LengthBudgetScorer``) first, then starts one worker and
profiles it until every verdict is out (the near-peak case: the worker never waits for
records), then for ``--idle-s`` seconds with nothing to do (the idle-polling cost).
Prints CPU seconds per 1,000 trajectories (``time.process_time`` of this process: the
worker, its clients and the verdict tail) and the profile's top frames by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from infra.kafka import ensure_topics
from infra.local import LocalStack
from prm_pipeline.observe import VerdictTail
from producers.publisher import TrajectoryPublisher
from scoring_workers.worker import Worker
from tests.perf.bench_pipeline import _config, _groups
from tests.polling import eventually

CALLERS: list[str] = []  # --callers: print who calls functions whose name contains these


def _top(profiler: object, n: int) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """(own, inclusive) time shares per function (file:line), largest first, from a pyinstrument session.

    Inclusive time counts a function once per call stack (recursion is not double counted)."""
    session = profiler.last_session  # type: ignore[attr-defined]
    own: dict[str, float] = {}
    incl: dict[str, float] = {}
    callers: dict[str, float] = {}

    def name_of(frame: object) -> str:
        return f"{frame.function} ({Path(frame.file_path or '?').name}:{frame.line_no})"  # type: ignore[attr-defined]

    def walk(frame: object, owner: str, stack: frozenset[str]) -> None:
        fn = frame.function  # type: ignore[attr-defined]
        if fn and fn.startswith("["):  # pyinstrument's synthetic [self]/[await] frames: counted with the parent
            return
        name = name_of(frame)
        own[name] = own.get(name, 0.0) + frame.total_self_time  # type: ignore[attr-defined]
        if CALLERS and any(c in name for c in CALLERS):
            key = f"{name} <- {owner}"
            callers[key] = callers.get(key, 0.0) + frame.time  # type: ignore[attr-defined]
        if name not in stack:
            incl[name] = incl.get(name, 0.0) + frame.time  # type: ignore[attr-defined]
        for child in frame.children:  # type: ignore[attr-defined]
            walk(child, name, stack | {name})

    root = session.root_frame()
    if root is None:
        return [], []
    walk(root, "?", frozenset())
    total = root.time or 1.0
    for k, t in sorted(callers.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  caller {t / total * 100:5.1f}%  {k}")
    return (
        sorted(((t / total, k) for k, t in own.items()), reverse=True)[:n],
        sorted(((t / total, k) for k, t in incl.items()), reverse=True)[: n * 2],
    )


async def _run(args: argparse.Namespace) -> None:
    from pyinstrument import Profiler

    with tempfile.TemporaryDirectory(prefix="prm-prof-") as tmp, LocalStack(Path(tmp) / "stack") as stack:
        if True:
            cfg = _config(stack, f"prof{uuid.uuid4().hex[:6]}", concurrency=64)
            cfg = msgspec.structs.replace(
                cfg, worker=msgspec.structs.replace(cfg.worker, verdict_tokens=args.verdict_tokens)
            )
            await ensure_topics(cfg.kafka, cfg.topics)
            groups = _groups(args.groups, 4, 8, 512, "p")
            async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                for g in groups:
                    await pub.publish_many(g)
            n = sum(len(g) for g in groups)
            tail = VerdictTail(cfg, decode=False)
            await tail.start()
            stop = asyncio.Event()
            worker = Worker(cfg, worker_id="prof")
            profiler = Profiler(interval=0.0005, async_mode="disabled") if args.profile else None
            task = asyncio.create_task(worker.run(stop))
            await worker.ready.wait()
            gc.collect()
            gc.freeze()  # as the worker command does once ready (prm_pipeline.cli)
            print("busy phase starts", flush=True)  # an outside sampler (py-spy --pid) may attach here
            c0, t0 = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.start()
            want = {g[0].group_id for g in groups}
            await eventually(lambda: want <= tail.arrivals.keys(), timeout_s=600, what="every group's verdict")
            busy_cpu, busy_wall = time.process_time() - c0, time.perf_counter() - t0
            if profiler is not None:
                profiler.stop()
            if args.idle_profile:
                profiler = Profiler(interval=0.0005, async_mode="disabled")
                profiler.start()
            c1 = time.process_time()
            await asyncio.sleep(args.idle_s)
            idle_cpu = time.process_time() - c1
            if args.idle_profile:
                profiler.stop()
            stop.set()
            await task
            await tail.aclose()
    print(
        f"{n} trajectories in {busy_wall:.2f}s ({n / busy_wall:.0f}/s); CPU {busy_cpu:.2f}s = "
        f"{busy_cpu / n * 1000:.2f} CPU-s per 1,000 trajectories (worker + verdict tail, one process)"
    )
    print(f"idle: {idle_cpu:.2f} CPU-s over {args.idle_s:g}s ({idle_cpu / args.idle_s * 100:.1f}% of a core)")
    if profiler is None:
        return
    own, incl = _top(profiler, args.top)
    print("top functions by own time:")
    for share, name in own:
        print(f"  {share * 100:5.1f}%  {name}")
    print("top functions by inclusive time:")
    for share, name in incl:
        print(f"  {share * 100:5.1f}%  {name}")
    if args.html:
        Path(args.html).write_text(profiler.output_html())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=500)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--verdict-tokens", choices=["inline", "reference"], default="inline")
    ap.add_argument("--html", default=None)
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="CPU figures only (no sampling)")
    ap.add_argument("--callers", nargs="*", default=[])
    ap.add_argument("--idle-profile", action="store_true", help="profile the idle phase instead of the busy one")
    args = ap.parse_args(argv)
    CALLERS[:] = args.callers
    asyncio.run(_run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
