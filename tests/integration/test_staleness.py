"""The staleness bound (``trainer.max_policy_lag``) on real verdicts from a real worker.

Groups rolled out by policies v0..v3 (and one whose members do not say) go through a
worker; the trainer's consumer at policy v3 with ``max_policy_lag: 1`` trains v2, v3 and
the unversioned group, drops v0 and v1 and counts them as ``pipeline/filter/stale``, also
in its Prometheus metrics. A group buffered before the trainer's version moves on is
dropped when it moves; with the bound off nothing is dropped.
"""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import generate_latest

from infra.config import PipelineConfig, TrainerConfig
from prm_pipeline.demo.synthetic import make_session
from producers.publisher import TrajectoryPublisher
from shaper import VerdictConsumer
from shaper.telemetry import TrainerTelemetry
from tests.integration.harness import running_worker, wait_for_verdicts
from tests.polling import eventually

pytestmark = pytest.mark.integration

VERSIONS = {"v0": 0, "v1": 1, "v2": 2, "v3": 3, "unversioned": None}


async def publish_versions(cfg: PipelineConfig) -> None:
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        for name, version in VERSIONS.items():
            for m in range(2):
                await pub.publish_ready(
                    make_session(
                        trajectory_id=f"{name}-{m}",
                        session_id=f"{name}-{m}",
                        group_id=name,
                        group_size=2,
                        turns=2,
                        output_tokens=8,
                        policy_version=version,
                        outcome_reward=float(m),
                    )
                )


def with_trainer(cfg: PipelineConfig, group: str, max_policy_lag: int | None) -> PipelineConfig:
    return msgspec.structs.replace(cfg, trainer=TrainerConfig(group_id=group, max_policy_lag=max_policy_lag))


async def consume_all(consumer: VerdictConsumer, expected: int) -> set[str]:
    """Every group handed out, until ``expected`` verdicts were counted (deadline-bounded)."""
    got: set[str] = set()

    async def read() -> None:
        batch = await consumer.next_batch(idle_timeout_s=0.5)
        if batch is not None:
            got.update(batch.group_ids)

    await eventually(
        lambda: sum(v for k, v in consumer.totals().items() if k.startswith("pipeline/verdicts/")) >= expected,
        timeout_s=30,
        between=read,
        what=lambda: f"{expected} verdicts counted: {consumer.totals()}",
    )
    return got


async def test_groups_behind_the_bound_are_dropped_and_counted(
    pipeline_config: PipelineConfig, unique_name: str
) -> None:
    cfg = pipeline_config
    async with running_worker(cfg, "w-stale"):
        await publish_versions(cfg)
        verdicts = await wait_for_verdicts(cfg, VERSIONS)
    assert {v.group_id: v.status for v in verdicts} == dict.fromkeys(VERSIONS, "accepted")
    assert {v.group_id: v.sessions[0].policy_version for v in verdicts} == VERSIONS

    bounded = with_trainer(cfg, f"trainer.{unique_name}", max_policy_lag=1)
    async with VerdictConsumer(bounded, group_filter=None, device="cpu", batch_groups=16) as consumer:
        consumer.set_policy_version(3)
        trained = await consume_all(consumer, len(VERSIONS))
        assert trained == {"v2", "v3", "unversioned"}
        assert consumer.totals()["pipeline/filter/stale"] == 2
        text = generate_latest(TrainerTelemetry(consumer).registry).decode()
        assert 'prm_trainer_pipeline_total{counter="filter/stale"} 2.0' in text
        assert "prm_trainer_policy_version 3.0" in text and "prm_trainer_max_policy_lag 1.0" in text

    # buffered first (no version known yet: nothing is stale), then the trainer moves on to v4
    later = with_trainer(cfg, f"trainer2.{unique_name}", max_policy_lag=1)
    async with VerdictConsumer(later, group_filter=None, device="cpu", batch_groups=16) as consumer:

        async def read_none() -> None:
            assert await consumer.next_batch(idle_timeout_s=0.5, flush_partial=False) is None

        await eventually(
            lambda: consumer.buffered_groups >= len(VERSIONS),
            timeout_s=30,
            between=read_none,
            what=lambda: f"{len(VERSIONS)} groups buffered, not {consumer.buffered_groups}",
        )
        consumer.set_policy_version(4)
        assert consumer.buffered_groups == 2  # v3 and the unversioned group
        assert consumer.totals()["pipeline/filter/stale"] == 3
        batch = await consumer.next_batch(idle_timeout_s=0.5)
        assert batch is not None and set(batch.group_ids) == {"v3", "unversioned"}

    unbounded = with_trainer(cfg, f"trainer3.{unique_name}", max_policy_lag=None)
    async with VerdictConsumer(unbounded, group_filter=None, device="cpu", batch_groups=16) as consumer:
        consumer.set_policy_version(100)
        assert await consume_all(consumer, len(VERSIONS)) == set(VERSIONS)
        assert "pipeline/filter/stale" not in consumer.totals()
