"""Running real worker processes and reading topics to their end, for integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

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
    WorkerConfig,
    load_config,
)
from infra.kafka import assign_from_start, ensure_topics, make_consumer
from infra.local import LOCAL_BROKER_CLIENT
from infra.schema import GroupVerdict, decode_verdict
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from tests.polling import poll_until

TEST_SCORER_MODULES = ["scoring_workers.scorers", "tests.scorers"]


def isolated_config(
    name: str,
    kafka_bootstrap: str,
    redis_url: str,
    *,
    scorers: Sequence[PRMScorerConfig] = (),
    partitions: int = 4,
    kafka: dict[str, Any] | None = None,
    **worker: Any,
) -> PipelineConfig:
    """A config of one test's own: topics, consumer group and Redis key prefix carry ``name``.

    Kafka client settings for the embedded broker (``infra.local.LOCAL_BROKER_CLIENT``:
    short sessions, leave by expiry); ``worker`` keys override :class:`WorkerConfig` fields.
    """
    worker.setdefault("allowed_scorer_modules", TEST_SCORER_MODULES)
    return PipelineConfig(
        rollout=RolloutConfig(agent=AgentConfig(prm=PRMConfig(scorers=list(scorers)))),
        actor=ActorConfig(token_rewards_as_adv=True),
        kafka=KafkaConfig(bootstrap=kafka_bootstrap, **{**LOCAL_BROKER_CLIENT, "linger_ms": 1, **(kafka or {})}),
        redis=RedisConfig(url=redis_url, key_prefix=f"prm-test:{name}", ttl_s=600),
        topics=TopicsConfig(
            trajectories=f"traj.{name}",
            verdicts=f"verd.{name}",
            dead_letters=f"dlq.{name}",
            experiments=f"exp.{name}",
            turn_samples=f"samples.{name}",
            partitions=partitions,
        ),
        worker=WorkerConfig(group_id=f"workers.{name}", **worker),
    )


async def read_topic(
    cfg: PipelineConfig, topic: str, *, until: float | None = None, stop_when: callable | None = None
) -> list:
    """Every record of ``topic`` from the beginning up to its current end (or ``stop_when``).

    The end is taken from ``highwater()`` after fetching (the embedded broker's
    ``end_offsets`` is wrong). With ``stop_when``, keeps polling until it returns True
    for the records read so far or the ``until`` deadline (monotonic) passes.
    """
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    records = []
    try:
        tps = await assign_from_start(consumer, topic)

        async def read_done() -> bool:
            batch = await consumer.getmany(timeout_ms=100)
            for rs in batch.values():
                records.extend(rs)
            if stop_when is not None:
                return bool(stop_when(records))
            for tp in tps:
                high = consumer.highwater(tp)
                if high is None or await consumer.position(tp) < high:
                    return False
            return True

        deadline = until if until is not None else time.monotonic() + 30
        await poll_until(read_done, timeout_s=deadline - time.monotonic(), interval_s=0)
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


def with_scorers(cfg: PipelineConfig, *scorers: PRMScorerConfig, **worker: Any) -> PipelineConfig:
    """``cfg`` scoring with ``scorers`` (AReaL's rules met: token rewards as advantages),
    ``worker`` keys overriding :class:`WorkerConfig` fields."""
    return msgspec.structs.replace(
        cfg,
        rollout=RolloutConfig(agent=AgentConfig(prm=PRMConfig(scorers=list(scorers)))),
        actor=ActorConfig(token_rewards_as_adv=True),
        worker=msgspec.structs.replace(cfg.worker, **worker),
    )


def demo_config_on(services: PipelineConfig) -> PipelineConfig:
    """``config/demo.yaml`` (its scorers, as a user runs it) on a test's own services and topics."""
    demo = load_config(Path(__file__).resolve().parents[2] / "config" / "demo.yaml", environ={})
    return msgspec.structs.replace(
        demo, kafka=services.kafka, redis=services.redis, topics=services.topics, worker=services.worker
    )


@contextlib.asynccontextmanager
async def running_worker(cfg: PipelineConfig, worker_id: str) -> AsyncIterator[Any]:
    """One in-process :class:`~scoring_workers.worker.Worker`, ready (group joined) on entry,
    stopped and drained on exit."""
    from scoring_workers.worker import Worker

    await ensure_topics(cfg.kafka, cfg.topics)
    worker = Worker(cfg, worker_id=worker_id)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(worker.ready.wait(), 30)
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def worker_processes(cfg: PipelineConfig, tmp: Path, n: int = 2) -> AsyncIterator[WorkerProcesses]:
    """``n`` ``prm-pipeline worker`` processes on ``cfg`` (logs under ``tmp``); on exit they
    must stop cleanly (exit code 0), else the assertion shows their logs."""
    await ensure_topics(cfg.kafka, cfg.topics)
    procs = WorkerProcesses(write_config(cfg, tmp / "config.yaml"), tmp, n=n)
    procs.start()
    try:
        yield procs
    finally:
        codes = procs.stop()
    assert codes == [0] * n, f"workers did not exit cleanly: {codes}\n{procs.logs()}"
