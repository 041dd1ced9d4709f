"""Watching the verdicts topic from the outside: arrival times per group (demo, benchmarks)."""

from __future__ import annotations

import asyncio
import time

from infra.config import PipelineConfig
from infra.experiments import DEFAULT_EXPERIMENT, verdicts_topic
from infra.kafka import assign_from_start, make_consumer
from infra.schema import GroupVerdict, SchemaError, decode_verdict


class VerdictTail:
    """Records each group's first verdict and its arrival time (``time.perf_counter``).

    Reads with no consumer group from the beginning, so it never disturbs anyone's
    offsets and sees verdicts published before it started. ``experiment`` picks the
    verdicts topic (docs/fleet.md); decoded verdicts of another experiment are ignored.
    """

    def __init__(self, cfg: PipelineConfig, *, decode: bool = True, experiment: str = DEFAULT_EXPERIMENT) -> None:
        self.cfg = cfg
        self.experiment = experiment
        self.decode = decode  # False: arrival times only (keys), no CPU spent decoding verdicts
        self.arrivals: dict[str, float] = {}
        self.verdicts: dict[str, GroupVerdict] = {}
        self.records = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.consumer = make_consumer(self.cfg.kafka, group_id=None, fetch_max_wait_ms=10)
        await self.consumer.start()
        try:
            await assign_from_start(self.consumer, verdicts_topic(self.cfg.topics.verdicts, self.experiment))
        except BaseException:  # a missing topic (TopicMissing): close the consumer, leak nothing
            await self.consumer.stop()
            raise
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            batch = await self.consumer.getmany(timeout_ms=50)
            now = time.perf_counter()
            for records in batch.values():
                for r in records:
                    self.records += 1
                    if not self.decode:
                        self.arrivals.setdefault(r.key.decode(), now)
                        continue
                    try:
                        verdict = decode_verdict(r.value, r.headers)
                    except SchemaError:
                        continue
                    if verdict.experiment_id != self.experiment:
                        continue
                    if verdict.group_id not in self.arrivals:
                        self.arrivals[verdict.group_id] = now
                        self.verdicts[verdict.group_id] = verdict

    async def wait_for(self, groups: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not groups <= self.arrivals.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(groups - self.arrivals.keys())} groups without verdict after {timeout_s}s")
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        """Stop reading and close the consumer (what was recorded stays readable)."""
        self._stop.set()
        if self._task:
            await self._task
        await self.consumer.stop()
