"""A worker that starts after ``experiment remove`` does not bring the experiment back.

The registry is read from its beginning at start-up: a declaration followed by its
removal leaves nothing once the removal is older than the experiment's group timeout
(the records' timestamps say when), and a more recent removal retires the experiment
for the rest of its group timeout only. Real broker and Redis, an in-process worker.
"""

from __future__ import annotations

import time

import pytest

from infra.config import PipelineConfig, PRMConfig, PRMScorerConfig
from infra.experiments import trajectories_topic, verdicts_topic
from infra.kafka import ensure_topics, make_producer
from infra.registry import KIND, ExperimentSpec, encode_spec
from tests.integration.harness import running_worker, with_scorers

pytestmark = pytest.mark.integration

LENGTH = PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 32})
MINUTE_MS = 60_000


async def _registry_records(cfg: PipelineConfig, records: list[tuple[str, ExperimentSpec | None, int]]) -> None:
    """Write registry records as ``experiment add`` / ``remove`` do, stamped ``ago_ms`` in the past."""
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for experiment_id, spec, ago_ms in records:
            if spec is not None:
                await ensure_topics(
                    cfg.kafka,
                    cfg.topics,
                    [
                        trajectories_topic(cfg.topics.trajectories, experiment_id),
                        verdicts_topic(cfg.topics.verdicts, experiment_id),
                    ],
                )
                key, value, headers = encode_spec(spec)
            else:
                key, value, headers = (
                    experiment_id.encode(),
                    None,
                    [("prm-kind", KIND.encode()), ("prm-schema-version", b"1")],
                )
            await producer.send_and_wait(
                cfg.topics.experiments, value, key=key, headers=headers, timestamp_ms=int(time.time() * 1000) - ago_ms
            )
    finally:
        await producer.stop()


async def test_a_worker_started_after_a_removal_does_not_serve_or_retire_the_experiment_again(pipeline_config) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    await ensure_topics(cfg.kafka, cfg.topics)

    def spec(experiment_id: str) -> ExperimentSpec:
        return ExperimentSpec(experiment_id=experiment_id, prm=PRMConfig(scorers=[LENGTH]), group_timeout_s=600)

    await _registry_records(
        cfg,
        [
            ("exp-gone", spec("exp-gone"), 30 * MINUTE_MS),
            ("exp-gone", None, 20 * MINUTE_MS),  # removed 20 min ago
            ("exp-late", spec("exp-late"), 9 * MINUTE_MS),
            ("exp-late", None, 7 * MINUTE_MS),  # removed 7 min ago
            ("exp-kept", spec("exp-kept"), 5 * MINUTE_MS),
        ],
    )
    gone_topic = trajectories_topic(cfg.topics.trajectories, "exp-gone")
    async with running_worker(cfg, "w-catch-up") as worker:
        assert worker.fleet.get("exp-kept") is not None and worker.fleet.get("exp-kept").state == "active"
        assert worker.fleet.get("exp-gone") is None  # removed longer ago than its group timeout: nothing
        assert gone_topic not in worker.consumer.subscription()
        retiring = worker.fleet.get("exp-late")  # removed 7 of its 10 minutes ago: the remaining 3 only
        assert retiring is not None and retiring.state == "retiring"
        assert 170 < retiring.retire_at - time.monotonic() <= 181, retiring.retire_at - time.monotonic()
