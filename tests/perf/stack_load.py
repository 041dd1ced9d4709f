"""The whole pipeline as separate processes on the embedded stack, for ``bench soak`` and ``bench capacity``.

Broker, Redis, two ``prm-pipeline worker`` processes, a publisher process and a trainer
consumer process, each its own pid so :mod:`tests.perf.procstats` can charge CPU and
memory to the right component. The benchmark process itself only watches: it tails the
verdicts topic (no decoding) and reads the children's status files.

The publisher and trainer children are this module run as a script::

    python -m tests.perf.stack_load publisher --config C --status S --sent LOG --rate R [--groups N]
    python -m tests.perf.stack_load trainer --config C --status S

The publisher appends ``group_id t`` to ``LOG`` once each group is acknowledged, where
``t`` is ``time.perf_counter()`` — ``CLOCK_MONOTONIC`` on Linux, the same clock in every
process of the machine — so publish-to-verdict latency is measured across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec

from infra import event_loop
from infra.config import (
    ActorConfig,
    AgentConfig,
    KafkaConfig,
    PipelineConfig,
    PRMConfig,
    PRMScorerConfig,
    RedisConfig,
    RolloutConfig,
    TopicsConfig,
    TrainerConfig,
    WorkerConfig,
    load_config,
)
from infra.local import LocalStack, free_port
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from tests.polling import eventually

ROOT = Path(__file__).resolve().parents[2]


def perf_config(
    stack: LocalStack,
    name: str,
    *,
    ttl_s: int,
    dedupe_max_seen: int = 1_000_000,
    concurrency: int = 64,
    group_timeout_s: float = 120,
    dedupe_window_s: float = 3600.0,
    verdict_tokens: str = "inline",
) -> PipelineConfig:
    """The benchmark pipeline: LengthBudgetScorer (cheap, deterministic), zstd, short group joins."""
    return PipelineConfig(
        rollout=RolloutConfig(
            agent=AgentConfig(
                prm=PRMConfig(
                    scorers=[
                        PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 96}),
                    ]
                )
            )
        ),
        actor=ActorConfig(token_rewards_as_adv=True),
        kafka=KafkaConfig(bootstrap=stack.kafka_bootstrap, **stack.client_settings, max_message_bytes=8 * 1024 * 1024),
        redis=RedisConfig(url=stack.redis_url, key_prefix=f"perf:{name}", ttl_s=ttl_s),
        topics=TopicsConfig(
            trajectories=f"traj.{name}",
            verdicts=f"verd.{name}",
            dead_letters=f"dlq.{name}",
            experiments=f"exp.{name}",
            partitions=8,
        ),
        worker=WorkerConfig(
            group_id=f"workers.{name}",
            concurrency=concurrency,
            group_timeout_s=group_timeout_s,
            dedupe_window_s=dedupe_window_s,
            verdict_tokens=verdict_tokens,
        ),  # type: ignore[arg-type]
        trainer=TrainerConfig(
            group_id=f"trainer.{name}", batch_groups=8, device="cpu", dedupe_max_seen=dedupe_max_seen
        ),
    )


def read_status(path: Path) -> dict[str, Any]:
    """A child's last status (written atomically); empty before its first write."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_status(path: Path, status: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


class SentLog:
    """Incremental reader of the publisher's ``group_id t`` lines."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self.sent = path, 0, {}

    def poll(self) -> dict[str, float]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.sent
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            gid, t = line.split()
            self.sent[gid.decode()] = float(t)
        return self.sent


class Children:
    """The publisher / trainer child processes of one run (SIGTERM on exit)."""

    def __init__(self, config_path: Path, workdir: Path) -> None:
        self.config_path, self.workdir = config_path, workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, role: str, *args: str, name: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        name = name or role
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.perf.stack_load",
                role,
                "--config",
                str(self.config_path),
                "--status",
                str(self.status_path(name)),
                *args,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                **(env or {}),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            },
        )
        log.close()
        self.procs[name] = proc
        return proc

    def status_path(self, name: str) -> Path:
        return self.workdir / f"{name}.status.json"

    def status(self, name: str) -> dict[str, Any]:
        return read_status(self.status_path(name))

    def check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None and proc.returncode != 0:
            raise RuntimeError(
                f"{name} exited with {proc.returncode}:\n"
                + (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
            )

    def stop(self, name: str, timeout_s: float = 30) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)


@asynccontextmanager
async def running_stack(
    workdir: Path, name: str, *, counted: bool = False, broker: str = "tansu", **config: Any
) -> AsyncIterator[tuple[LocalStack, PipelineConfig, WorkerProcesses, Children]]:
    """Broker (``tansu`` or ``noida``) + Redis + topics + two workers; children started by the
    caller. Stops everything on exit.

    ``counted=True`` puts a byte-counting proxy (``stack.proxy``) in front of the broker.
    """
    from infra.kafka import ensure_topics
    from tests.perf.kafka_proxy import KafkaCountingProxy

    stack = LocalStack(workdir / "stack", broker=broker)
    proxy = None
    if counted:  # clients reach the broker only through a byte-counting proxy
        port = free_port()
        argv = stack.broker.argv
        if "--advertised-listener-url" in argv:  # tansu advertises the proxy; noida's answers are rewritten
            argv[argv.index("--advertised-listener-url") + 1] = f"tcp://127.0.0.1:{port}"
    with stack:
        if counted:
            proxy = KafkaCountingProxy(stack.broker.port, port=port).start()
        cfg = perf_config(stack, name, **config)
        if proxy is not None:
            cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap=f"127.0.0.1:{port}"))
        stack.proxy = proxy  # type: ignore[attr-defined]
        await ensure_topics(cfg.kafka, cfg.topics)
        path = write_config(cfg, workdir / "config.yaml")
        (workdir / "workers").mkdir(exist_ok=True)
        workers = WorkerProcesses(path, workdir / "workers", n=2, cwd=ROOT)
        children = Children(path, workdir)
        workers.start()
        try:
            await workers_assigned(workers)
            yield stack, cfg, workers, children
        finally:
            children.stop_all()
            workers.stop()
            if proxy is not None:
                proxy.stop()


def while_alive(cond: Callable[[], object], children: Children, *names: str) -> Callable[[], object]:
    """``cond`` as a check for :mod:`tests.polling` that, while false, fails at once if a named
    child exited with an error (instead of waiting out the deadline)."""

    def check() -> object:
        if held := cond():
            return held
        for n in names:
            children.check_alive(n)
        return held

    return check


async def workers_assigned(workers: WorkerProcesses, timeout_s: float = 120) -> None:
    """Wait until every worker process has logged a non-empty partition assignment: the
    group has formed with all of them before the first record. noida-db 0.2.3 needs it: a
    member joining while another commits offsets makes the commits fail (illegal
    generation) and, in the pipeline, the group never forms again (docs/capacity.md)."""
    import re

    pattern = re.compile(rb"worker \S+ assigned \[('[^\]]+)\]")

    def done() -> bool:
        for k, proc in enumerate(workers.procs):
            if proc is None:
                continue
            try:
                text = (workers.log_dir / f"worker{k}.{workers.starts[k]}.log").read_bytes()
            except FileNotFoundError:
                return False
            if not pattern.search(text):
                return False
        return True

    await eventually(done, timeout_s=timeout_s, what="every worker to be assigned partitions")


def stack_pids(stack: LocalStack, workers: WorkerProcesses, children: Children) -> dict[str, int]:
    pids = {"broker": stack.broker.pid, "redis": stack.redis.pid}
    for i, p in enumerate(workers.procs):
        if p is not None and p.poll() is None:
            pids[f"worker{i}"] = p.pid
    for name, p in children.procs.items():
        if p.poll() is None:
            pids[name] = p.pid
    return {k: v for k, v in pids.items() if v}


# --------------------------------------------------------------------------- child roles
def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _publisher(args: argparse.Namespace) -> None:
    """Publish fresh groups at ``--rate`` trajectories/s (0 = as fast as acknowledgements allow)."""
    import numpy as np

    from prm_pipeline.demo.synthetic import make_group
    from producers.publisher import TrajectoryPublisher

    cfg = load_config(args.config)
    stop = _stop_event()
    rng = np.random.default_rng(7)
    # A pool of shapes, re-labelled per group: generation is not publishing, keep it off the CPU bill.
    pool = [
        make_group(
            f"tmpl{i}", args.group_size, rng=rng, turns=args.turns, output_tokens=(args.tokens // 2, args.tokens)
        )
        for i in range(32)
    ]
    run = args.run_id or f"{os.getpid()}"
    interval = args.group_size / args.rate if args.rate > 0 else 0.0
    sent = open(args.sent, "a", buffering=1)
    n = 0
    t_start = time.perf_counter()
    last_status = 0.0
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        while not stop.is_set() and (args.groups is None or n < args.groups):
            if interval:
                delay = t_start + n * interval - time.perf_counter()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)  # pacing the load, not a sync point
                        break
                    except TimeoutError:
                        pass
            gid = f"{run}-g{n:07d}"
            members = [
                msgspec.structs.replace(
                    t, group_id=gid, trajectory_id=f"{gid}-traj{i}", session_id=f"{gid}-s{i}", created_at=time.time()
                )
                for i, t in enumerate(pool[n % len(pool)])
            ][: args.members]
            await pub.publish_many(members)
            if interval:
                await pub.flush()
                sent.write(f"{gid} {time.perf_counter()}\n")
            else:
                sent.write(f"{gid} {time.perf_counter()}\n")  # burst: queued time
            n += 1
            now = time.perf_counter()
            if now - last_status >= 1.0:
                _write_status(Path(args.status), {"groups": n, "trajectories": n * args.group_size})
                last_status = now
        await pub.flush()
    sent.close()
    _write_status(Path(args.status), {"groups": n, "trajectories": n * args.group_size, "done": True})


async def _trainer(args: argparse.Namespace) -> None:
    """The reference verdict consumer: batches are built (rows, padding) and dropped."""
    from shaper.consumer import VerdictConsumer

    cfg = load_config(args.config)
    stop = _stop_event()
    groups = batches = 0
    last = 0.0
    async with VerdictConsumer(cfg, group_filter=None, device="cpu") as consumer:
        while not stop.is_set():
            batch = await consumer.next_batch(idle_timeout_s=0.5)
            if batch is not None:
                batches += 1
                groups += len(set(batch.group_ids))
            now = time.perf_counter()
            if now - last >= 1.0:
                totals = consumer.metrics.totals()
                _write_status(
                    Path(args.status),
                    {
                        "dedupe_size": consumer.dedupe_size,
                        "max_seen": consumer.max_seen,
                        "batches": batches,
                        "groups": groups,
                        "duplicates": next((v for k, v in totals.items() if k.endswith("verdicts/duplicate")), 0),
                    },
                )
                last = now


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.perf.stack_load")
    p.add_argument("role", choices=["publisher", "trainer"])
    p.add_argument("--config", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--sent", default=os.devnull)
    p.add_argument("--rate", type=float, default=0.0, help="trajectories/s; 0 = unpaced")
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--run-id", default=None)
    p.add_argument("--members", type=int, default=None, help="publish only the first N members of each group")
    args = p.parse_args(argv)
    if args.role == "publisher":  # a rollout proxy's loop is its own business
        asyncio.run(_publisher(args))
    else:  # the trainer consumer runs on the loop `prm-pipeline trainer` runs on
        event_loop.run(_trainer(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
