"""Worker processes for the demo, benchmarks and tests: ``prm-pipeline worker`` children.

Running workers as real processes (not tasks) is what makes the demo and the crash
tests honest: they share nothing but Kafka and Redis, and SIGKILL means SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import yaml

from infra.config import PipelineConfig


def write_config(cfg: PipelineConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    return path


class WorkerProcesses:
    """N ``prm-pipeline worker`` processes sharing one config file; logs under ``log_dir``."""

    def __init__(
        self, config_path: Path, log_dir: Path, n: int = 2, concurrency: int | None = None, cwd: Path | None = None
    ) -> None:
        self.config_path, self.log_dir = config_path, log_dir
        # Scorer classes named by import path must be importable by the children:
        # they run in (and have on their path) the caller's working directory.
        self.cwd = cwd or Path.cwd()
        self.concurrency = concurrency
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.starts = [0] * n
        self.ended_on_purpose: set[int] = set()  # pids this object SIGKILLed or SIGTERMed
        self.crashed: list[tuple[str, int]] = []  # (log name, exit code) of workers that ended by themselves

    def start(self, i: int | None = None) -> None:
        for k in range(len(self.procs)) if i is None else [i]:
            self._note_exit(k)  # a slot restarted after its worker died by itself must not hide it
            self.starts[k] += 1
            log = (self.log_dir / f"worker{k}.{self.starts[k]}.log").open("wb")
            argv = [
                sys.executable,
                "-m",
                "prm_pipeline.cli",
                "--config",
                str(self.config_path),
                "worker",
                "--worker-id",
                f"w{k}.{self.starts[k]}",
            ]
            if self.concurrency:
                argv += ["--concurrency", str(self.concurrency)]
            self.procs[k] = subprocess.Popen(
                argv,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(self.cwd), os.environ.get("PYTHONPATH")])),
                },
            )
            log.close()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            self.ended_on_purpose.add(proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def _note_exit(self, k: int) -> None:
        proc = self.procs[k]
        if proc is not None and proc.poll() is not None and proc.pid not in self.ended_on_purpose:
            self.ended_on_purpose.add(proc.pid)  # noted once
            self.crashed.append((f"worker{k}.{self.starts[k]}.log", proc.returncode))

    def unexpected_exits(self) -> list[tuple[str, int]]:
        """Workers that ended although nobody stopped them: ``(log name, exit code)``."""
        for k in range(len(self.procs)):
            self._note_exit(k)
        return list(self.crashed)

    def alive(self) -> list[bool]:
        return [p is not None and p.poll() is None for p in self.procs]

    def stop(self, timeout_s: float = 30.0) -> list[int | None]:
        """SIGTERM all (graceful drain + commit), wait, SIGKILL stragglers; return exit codes."""
        self.unexpected_exits()
        for p in self.procs:
            if p is not None and p.poll() is None:
                self.ended_on_purpose.add(p.pid)
                p.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for p in self.procs:
            if p is None:
                codes.append(None)
                continue
            try:
                codes.append(p.wait(timeout_s))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(self.log_dir.glob("worker*.log"))
        )
