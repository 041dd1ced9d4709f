"""``make demo``: the whole pipeline on the embedded stack, printing what it did.

1. start the embedded Kafka-protocol broker and Redis, create the topics;
2. start two ``prm-pipeline worker`` processes (scorers from the config file);
3. a synthetic rollout proxy publishes a few hundred GRPO groups of varied lengths —
   some discarded, some with a member that never arrives (rejected after the group
   deadline), some with a session that is not concat export (rejected by scoring);
4. the trainer-side ``VerdictConsumer`` turns accepted verdicts into batches and shapes
   advantages, printing one line per step;
5. a summary: verdicts by status and reason, end-to-end throughput and latency.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from infra.config import PipelineConfig, load_config
from infra.kafka import ensure_topics
from infra.local import LocalStack
from infra.schema import DiscardGroup, Interaction, ModelResponse, ReadyTrajectory
from prm_pipeline.observe import VerdictTail
from prm_pipeline.processes import WorkerProcesses, write_config
from producers.publisher import TrajectoryPublisher
from producers.synthetic import make_group

DEMO_GROUP_TIMEOUT_S = 6.0


def _break_concat(traj: ReadyTrajectory) -> ReadyTrajectory:
    """Make the last turn's input disagree with its parent's (a non-concat export)."""
    last = traj.interactions[-1]
    mr = last.model_response
    tokens = mr.input_tokens.copy()
    tokens[0] += 1  # inside the history the parent produced
    bad = Interaction(interaction_id=last.interaction_id, parent_id=last.parent_id, messages=last.messages,
                      output_message_list=last.output_message_list,
                      model_response=ModelResponse.from_arrays(tokens, mr.output_tokens, mr.output_logprobs))
    return msgspec.structs.replace(traj, interactions=[*traj.interactions[:-1], bad])


def synthetic_proxy(n_groups: int, group_size: int, seed: int = 0) -> tuple[list[list], dict[str, tuple[str, str]]]:
    """Messages per group, and the ``(status, reason)`` each group is expected to get."""
    rng = np.random.default_rng(seed)
    plan: list[list] = []
    expect: dict[str, tuple[str, str]] = {}
    for g in range(n_groups):
        gid = f"demo-g{g:04d}"
        members = make_group(gid, group_size, rng=rng, turns=int(rng.integers(2, 7)), output_tokens=(16, 256),
                             branch_at=0 if g % 7 == 3 else None)
        if g % 20 == 19:
            plan.append([*members[:2], DiscardGroup(group_id=gid, reason="prompt filtered by the proxy")])
            expect[gid] = ("discarded", "prompt filtered by the proxy")
        elif g % 25 == 12:
            plan.append(members[:-1])  # one rollout never finishes
            expect[gid] = ("rejected", "missing_sessions")
        elif g % 30 == 7:
            plan.append([*members[:-1], _break_concat(members[-1])])
            expect[gid] = ("rejected", "not_concat_export")
        else:
            plan.append(members)
            expect[gid] = ("accepted", "")
    return plan, expect


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def _run(cfg: PipelineConfig, workdir: Path, n_groups: int) -> int:
    from shaper.trainer import format_step, run_trainer

    created = await ensure_topics(cfg.kafka, cfg.topics)
    print(f"topics: {', '.join(f'{n} ({s})' for n, s in created.items())}")
    scorers = ", ".join(f"{s.path}(weight={s.weight}, {s.kwargs})" for s in cfg.prm.scorers) or "none"
    print(f"scorers: {scorers}; shaping mode: {cfg.prm.advantage_shaping.mode}")

    procs = WorkerProcesses(write_config(cfg, workdir / "config.yaml"), workdir, n=2)
    procs.start()
    tail = VerdictTail(cfg)
    await tail.start()
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:  # a discarded probe: workers are up
        await pub.discard_group("demo-warmup", "warm-up probe")
    await tail.wait_for({"demo-warmup"}, timeout_s=60)
    print(f"started 2 scoring workers (logs in {workdir})")
    plan, expect = synthetic_proxy(n_groups, 4)
    n_traj = sum(1 for wave in plan for m in wave if isinstance(m, ReadyTrajectory))

    n_accepted = sum(1 for status, _ in expect.values() if status == "accepted")
    stop_trainer = asyncio.Event()
    trained = 0

    def on_step(report) -> None:
        nonlocal trained
        trained += report.groups
        print("  " + format_step(report))
        if trained >= n_accepted:
            stop_trainer.set()  # every accepted group reached the trainer
    # The trainer runs beside the workers; after 5 s without verdicts it trains on the
    # last partial batch and ends (or earlier, once every accepted group reached it).
    trainer = asyncio.create_task(run_trainer(cfg, on_step=on_step, stop=stop_trainer, idle_timeout_s=5.0,
                                              batch_groups=cfg.trainer.batch_groups))
    sent_at: dict[str, float] = {}
    try:
        print(f"publishing {n_groups} groups ({n_traj} trajectories) ...")
        t0 = time.perf_counter()
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            for wave in plan:
                await pub.publish_many(wave)
                sent_at[wave[0].group_id] = time.perf_counter()  # queued; acked later (conservative)
            await pub.flush()
        publish_s = time.perf_counter() - t0
        print(f"published in {publish_s:.2f}s; trainer steps:")
        await tail.wait_for(set(expect), timeout_s=DEMO_GROUP_TIMEOUT_S + 90)
        summary = await asyncio.wait_for(trainer, timeout=60)
    finally:
        stop_trainer.set()
        await tail.stop()
        codes = procs.stop()

    verdicts = {g: v for g, v in tail.verdicts.items() if g in expect}
    by_status = collections.Counter(v.status for v in verdicts.values())
    by_reason = collections.Counter((v.status, v.reason.split(":", 1)[0]) for v in verdicts.values() if v.reason)
    wrong = {g: (expect[g], (v.status, v.reason)) for g, v in verdicts.items()
             if expect[g] != (v.status, v.reason.split(":", 1)[0])}
    prompt = [g for g, (_, reason) in expect.items() if reason != "missing_sessions"]  # no deadline wait
    latencies = sorted(tail.arrivals[g] - sent_at[g] for g in prompt)
    done = max(tail.arrivals[g] for g in prompt)
    print()
    print("summary")
    print(f"  verdicts: {dict(by_status)}  (distinct groups {len(verdicts)}, records read {tail.records})")
    for (status, reason), n in sorted(by_reason.items()):
        print(f"    {status:9} {reason:22} {n}")
    print(f"  trainer: {summary.steps} steps ({summary.stop_reason}), {summary.groups} groups, {summary.rows} rows, {summary.tokens} "
          f"loss tokens on {summary.device}, mode {summary.mode}")
    print(f"  throughput: {n_traj / (done - t0):.0f} trajectories/s publish-to-verdict "
          f"(groups waiting for a missing member excluded)")
    print(f"  latency (publish -> verdict): p50 {_pct(latencies, 0.5) * 1e3:.0f} ms, "
          f"p99 {_pct(latencies, 0.99) * 1e3:.0f} ms; missing-member groups wait for the "
          f"{DEMO_GROUP_TIMEOUT_S:.0f}s deadline")
    print(f"  workers exited with {codes}")
    if wrong:
        print(f"  UNEXPECTED verdicts: {dict(list(wrong.items())[:10])}")
    ok = not wrong and codes == [0, 0] and summary.groups == by_status["accepted"]
    if summary.groups != by_status["accepted"]:
        print(f"  trainer saw {summary.groups} groups, expected {by_status['accepted']}")
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


def run_demo(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    with tempfile.TemporaryDirectory(prefix="prm-demo-") as tmp:
        with LocalStack(Path(tmp) / "stack", broker_binary=cfg.local.broker_binary,
                        redis_binary=cfg.local.redis_binary) as stack:
            print(f"embedded stack: kafka {stack.kafka_bootstrap}, redis {stack.redis_url}")
            cfg = msgspec.structs.replace(
                cfg,
                kafka=msgspec.structs.replace(cfg.kafka, bootstrap=stack.kafka_bootstrap, session_timeout_ms=3000,
                                              heartbeat_interval_ms=1000),
                redis=msgspec.structs.replace(cfg.redis, url=stack.redis_url),
                worker=msgspec.structs.replace(cfg.worker, group_timeout_s=DEMO_GROUP_TIMEOUT_S),
            )
            workdir = Path(tmp) / "workers"
            workdir.mkdir()
            return asyncio.run(_run(cfg, workdir, args.groups or 300))
