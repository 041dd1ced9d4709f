"""Scaling up and down exactly as the README's quick session does it.

`prm-pipeline up --create-topics`, then `prm-pipeline --config config/demo.yaml worker`
processes started one after another (default config, the CLI, real processes), workers
added and removed while groups flow. Every worker that was not stopped on purpose must
still be running at the end, and every group must get its verdict.

Why this test exists: a worker's periodic lag step read ``consumer.highwater()`` for a
partition that a rebalance (the next worker joining) had just revoked; aiokafka asserts
on that and the worker died with exit 1 each time a worker joined. The storm test
restarts its slots whatever happened to them, so a worker that died by itself was
replaced before anything looked at it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from infra.config import load_config
from infra.local import LOCAL_BROKER_ENV
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from tests.integration.harness import read_topic
from tests.polling import eventually, wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "prm_pipeline.cli"]


@contextmanager
def embedded_stack(workdir: Path) -> Iterator[dict[str, str]]:
    """`prm-pipeline up --create-topics` in the foreground of a child; yields the exported settings."""
    out = workdir / "up.log"
    with out.open("wb") as log:
        proc = subprocess.Popen([*CLI, "up", "--create-topics"], cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    try:

        def settings() -> dict[str, str]:
            lines = out.read_text(errors="replace").splitlines()
            return dict(line.split("=", 1) for line in lines if line.startswith("PRM_") and "=" in line)

        wait_until(
            lambda: len(settings()) >= 2 + len(LOCAL_BROKER_ENV) or proc.poll() is not None,
            timeout_s=120,
            interval_s=0.2,
            what=lambda: f"prm-pipeline up\n{out.read_text(errors='replace')}",
        )
        assert proc.poll() is None, out.read_text(errors="replace")
        yield settings()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Workers:
    """`prm-pipeline --config config/demo.yaml worker` processes, as the README starts them."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir = env, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped_on_purpose: set[str] = set()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def start(self, name: str, argv: Sequence[str] = ("--config", "config/demo.yaml", "worker")) -> None:
        with (self.log_dir / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                [*CLI, *argv], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        wait_until(
            lambda: "polling" in self.log(name) or self.procs[name].poll() is not None,
            timeout_s=120,
            interval_s=0.2,
            what=lambda: f"{name} to poll\n{self.diagnosis()}",
        )
        assert self.procs[name].poll() is None, f"{name} exited at start-up\n{self.diagnosis()}"

    def stop(self, name: str) -> int:
        self.stopped_on_purpose.add(name)
        proc = self.procs[name]
        proc.send_signal(signal.SIGTERM)
        return proc.wait(90)

    def died(self) -> dict[str, int]:
        """Workers that ended although nobody stopped them, with their exit codes."""
        return {
            n: p.returncode for n, p in self.procs.items() if n not in self.stopped_on_purpose and p.poll() is not None
        }

    def diagnosis(self) -> str:
        return "\n".join(f"--- {n} (exit {p.poll()})\n{self.log(n)[-4000:]}" for n, p in self.procs.items())

    def stop_all(self) -> dict[str, int]:
        running = [n for n, p in self.procs.items() if p.poll() is None]
        for n in running:
            self.procs[n].send_signal(signal.SIGTERM)
        return {n: self.procs[n].wait(90) for n in running}


async def test_workers_join_and_leave_one_after_another_as_the_readme_runs_them(tmp_path) -> None:
    with embedded_stack(tmp_path) as settings:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRM_")} | settings
        cfg = load_config(REPO / "config" / "demo.yaml", environ=settings)
        workers = Workers(env, tmp_path)
        run = uuid.uuid4().hex[:6]
        published: list[str] = []
        stop_load = asyncio.Event()

        async def load() -> None:  # groups keep flowing through every join and leave
            async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                i = 0
                while not stop_load.is_set():
                    group_id = f"scale-{run}-{i}"
                    for traj in make_group(group_id, 2, turns=2, output_tokens=8):
                        await pub.publish(traj)
                    await pub.flush()
                    published.append(group_id)
                    i += 1
                    await asyncio.sleep(0.1)

        async def verdicts() -> set[str]:
            records = await read_topic(cfg, cfg.topics.verdicts)
            return {r.key.decode() for r in records}

        async def progress(step: str, more: int = 3) -> None:
            """A few groups published after this step get their verdicts (the pool works)."""
            target = len(published) + more

            async def progressed() -> bool:
                done = await verdicts()
                if len(published) >= target and set(published[:target]) <= done:
                    return True
                if died := workers.died():
                    raise AssertionError(f"{step}: workers died: {died}\n{workers.diagnosis()}")
                return False

            await eventually(
                progressed,
                timeout_s=90,
                interval_s=0.5,
                what=lambda: f"{step}: progress ({len(published)} groups)\n{workers.diagnosis()}",
            )

        publisher = asyncio.create_task(load())
        try:
            await asyncio.to_thread(workers.start, "w1")
            await progress("one worker")
            await asyncio.to_thread(workers.start, "w2")  # the README's "run it twice"
            await progress("w2 joined")
            await asyncio.to_thread(workers.start, "w3")
            await progress("w3 joined")
            assert await asyncio.to_thread(workers.stop, "w1") == 0, workers.diagnosis()
            await progress("w1 left")
            await asyncio.to_thread(workers.start, "w4")
            await progress("w4 joined")
        finally:
            stop_load.set()
            await publisher
        try:
            await progress("load stopped", more=0)
            assert set(published) <= await verdicts()
            assert workers.died() == {}, workers.diagnosis()
        finally:
            codes = await asyncio.to_thread(workers.stop_all)
        assert set(codes.values()) <= {0}, (codes, workers.diagnosis())


def readme_quick_session() -> list[str]:
    """The lines of the README's quick manual session, as written."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"A quick manual session:\s*```bash\n(.*?)```", text, re.S)
    assert block, "README.md lost its quick manual session"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_quick_session_runs_as_written_with_two_workers(tmp_path) -> None:
    lines = readme_quick_session()
    cli = ".venv/bin/prm-pipeline"
    assert lines[0] == f"{cli} up --create-topics &"
    with embedded_stack(tmp_path) as settings:
        exported = shlex.split(lines[1])
        assert exported[0] == "export" and sorted(v.split("=")[0] for v in exported[1:]) == sorted(settings)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRM_")} | settings
        workers = Workers(env, tmp_path)
        outputs: list[subprocess.CompletedProcess[str]] = []
        for line in lines[2:]:
            argv = shlex.split(line.removesuffix("&"))
            assert argv[0] == cli, line
            if line.endswith("&"):  # "run it twice for two workers"
                assert "worker" in argv
                workers.start("w1", argv[1:])
                workers.start("w2", argv[1:])
                continue
            outputs.append(
                subprocess.run([*CLI, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            )
            assert outputs[-1].returncode == 0, (line, outputs[-1].stderr, workers.diagnosis())
        try:
            assert workers.died() == {}, workers.diagnosis()
        finally:
            codes = workers.stop_all()
        assert set(codes.values()) <= {0}, (codes, workers.diagnosis())
    published, dumped, trained = outputs
    assert "published 3 ready trajectories and 1 discards" in published.stdout
    by_group = {v["group_id"]: v for v in map(json.loads, dumped.stdout.splitlines())}
    assert by_group["example-math"]["status"] == "accepted"
    dropped = by_group["example-dropped"]
    assert dropped["status"] == "discarded" and [s["status"] for s in dropped["sessions"]] == ["discarded"]
    assert "step" in trained.stdout + trained.stderr, trained
