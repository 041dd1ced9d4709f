"""Running real worker processes and reading topics to their end, for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec
import yaml
from aiokafka.structs import TopicPartition

from infra.config import PipelineConfig
from infra.kafka import make_consumer
from infra.schema import GroupVerdict, decode_verdict

REPO = Path(__file__).resolve().parents[2]


def write_config(cfg: PipelineConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))
    return path


class WorkerProcesses:
    """N ``prm-pipeline worker`` processes sharing one config file; logs under ``log_dir``."""

    def __init__(self, config_path: Path, log_dir: Path, n: int = 2, concurrency: int | None = None) -> None:
        self.config_path, self.log_dir = config_path, log_dir
        self.concurrency = concurrency
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.starts = [0] * n

    def start(self, i: int | None = None) -> None:
        for k in range(len(self.procs)) if i is None else [i]:
            self.starts[k] += 1
            log = (self.log_dir / f"worker{k}.{self.starts[k]}.log").open("wb")
            argv = [sys.executable, "-m", "prm_pipeline.cli", "--config", str(self.config_path), "worker",
                    "--worker-id", f"w{k}.{self.starts[k]}"]
            if self.concurrency:
                argv += ["--concurrency", str(self.concurrency)]
            self.procs[k] = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, "PYTHONPATH": str(REPO)})
            log.close()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def alive(self) -> list[bool]:
        return [p is not None and p.poll() is None for p in self.procs]

    def stop(self, timeout_s: float = 30.0) -> list[int | None]:
        """SIGTERM all (graceful drain + commit), wait, SIGKILL stragglers; return exit codes."""
        for p in self.procs:
            if p is not None and p.poll() is None:
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
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(self.log_dir.glob("worker*.log")))


async def read_topic(cfg: PipelineConfig, topic: str, *, until: float | None = None,
                     stop_when: callable | None = None) -> list:
    """Every record of ``topic`` from the beginning up to its current end (or ``stop_when``).

    The end is taken from ``highwater()`` after fetching (the embedded broker's
    ``end_offsets`` is wrong). With ``stop_when``, keeps polling until it returns True
    for the records read so far or the ``until`` deadline (monotonic) passes.
    """
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    records = []
    try:
        partitions = None
        while not partitions:
            await consumer._client.force_metadata_update()  # noqa: SLF001
            partitions = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning()
        deadline = until if until is not None else time.monotonic() + 30
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=100)
            for rs in batch.values():
                records.extend(rs)
            if stop_when is not None:
                if stop_when(records):
                    break
                continue
            at_end = True
            for tp in tps:
                high = consumer.highwater(tp)
                at_end = at_end and high is not None and await consumer.position(tp) >= high
            if at_end:
                break
        return records
    finally:
        await consumer.stop()


async def wait_for_verdicts(cfg: PipelineConfig, groups: Iterable[str], timeout_s: float = 60) -> list[GroupVerdict]:
    """Poll the verdicts topic until every group in ``groups`` has a verdict (or time out)."""
    wanted = set(groups)

    def seen_all(records: list) -> bool:
        return wanted <= {r.key.decode() for r in records}

    records = await read_topic(cfg, cfg.topics.verdicts, until=time.monotonic() + timeout_s, stop_when=seen_all)
    verdicts = [decode_verdict(r.value, r.headers) for r in records]
    missing = wanted - {v.group_id for v in verdicts}
    assert not missing, f"no verdict within {timeout_s}s for {sorted(missing)[:10]} ({len(missing)} groups)"
    return verdicts
