"""One worker fleet, many experiments: the registry followed live, group ids scoped, fair slots, quotas.

Real broker, real Redis, an in-process worker; experiments are declared through the
registry topic exactly as ``prm-pipeline experiment add`` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
import uuid

import msgspec
import pytest

from infra.config import PipelineConfig, PRMConfig, PRMScorerConfig
from infra.experiments import trajectories_topic, verdicts_topic
from infra.kafka import ensure_topics, make_producer
from infra.registry import ExperimentSpec, publish_removal, publish_spec
from infra.schema import GroupVerdict, decode_verdict, encode
from prm_pipeline.audit.run import AuditOptions, audit
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from tests.integration.harness import read_topic, running_worker, wait_for_verdicts, with_scorers
from tests.polling import eventually

pytestmark = pytest.mark.integration

LENGTH = PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 32})


def _slow(delay_s: float) -> PRMScorerConfig:
    return PRMScorerConfig("tests.scorers.SlowScorer", kwargs={"delay_s": delay_s})


def _spec(experiment_id: str, *scorers: PRMScorerConfig, **fields) -> ExperimentSpec:
    return ExperimentSpec(experiment_id=experiment_id, prm=PRMConfig(scorers=list(scorers)), **fields)


async def _declare(cfg: PipelineConfig, spec: ExperimentSpec) -> None:
    """What ``experiment add`` does: the experiment's topics, then the registry record."""
    await ensure_topics(
        cfg.kafka,
        cfg.topics,
        [
            trajectories_topic(cfg.topics.trajectories, spec.experiment_id),
            verdicts_topic(cfg.topics.verdicts, spec.experiment_id),
        ],
    )
    await publish_spec(cfg, spec)


async def _serving(worker, experiment_id: str, *, present: bool = True, timeout_s: float = 15) -> None:
    """Wait until the worker serves (or stopped serving) ``experiment_id`` and its topic's partitions
    are assigned to it (a subscription change rebalances the worker group)."""
    topic = trajectories_topic(worker.cfg.topics.trajectories, experiment_id)

    def settled() -> bool:
        served = worker.fleet.get(experiment_id) is not None
        assigned = any(tp.topic == topic for tp in worker.consumer.assignment())
        return served == present and assigned == present

    await eventually(
        settled, timeout_s=timeout_s, what=f"the worker to {'serve' if present else 'stop serving'} {experiment_id!r}"
    )


async def _publish(cfg: PipelineConfig, experiment_id: str | None, messages, *, topic_of: str | None = None) -> None:
    """Publish ``messages`` of ``experiment_id`` to its topic as a producer does, or — ``topic_of`` —
    stamped with it onto another experiment's topic, as a misconfigured producer would."""
    if topic_of is None:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics, experiment=experiment_id or "default") as pub:
            await pub.publish_many(messages)
        return
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for m in messages:
            value, headers = encode(msgspec.structs.replace(m, experiment_id=experiment_id))
            await producer.send_and_wait(
                trajectories_topic(cfg.topics.trajectories, topic_of), value, key=m.group_id.encode(), headers=headers
            )
    finally:
        await producer.stop()


async def _verdicts(
    cfg: PipelineConfig,
    experiment_id: str,
    groups: set[str],
    timeout_s: float = 30,
) -> dict[str, GroupVerdict]:
    topic = verdicts_topic(cfg.topics.verdicts, experiment_id)
    records = await read_topic(
        cfg, topic, until=time.monotonic() + timeout_s, stop_when=lambda rs: groups <= {r.key.decode() for r in rs}
    )
    out = {v.group_id: v for v in (decode_verdict(r.value, r.headers) for r in records) if v.group_id in groups}
    assert set(out) == groups, f"no verdict on {topic} within {timeout_s}s for {sorted(groups - set(out))}"
    return out


async def test_hot_added_experiment_is_scored_with_its_own_scorers_and_same_group_ids_stay_apart(
    pipeline_config,
) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    gid = f"same-{uuid.uuid4().hex[:6]}"
    async with running_worker(cfg, "w-fleet-add") as worker:
        await _declare(cfg, _spec("exp-a", _slow(0.0)))
        await _serving(worker, "exp-a")  # no restart: the worker follows the registry
        await _publish(cfg, None, make_group(gid, 2))
        await _publish(cfg, "exp-a", make_group(gid, 2))
        default = (await _verdicts(cfg, "default", {gid}))[gid]
        scoped = (await _verdicts(cfg, "exp-a", {gid}))[gid]
    assert default.status == scoped.status == "accepted"
    assert default.experiment_id == "default" and scoped.experiment_id == "exp-a"
    assert [s.name for s in default.scorers] == ["length_budget"]
    assert [s.name for s in scoped.scorers] == ["slow"]  # the experiment's own stack
    assert len(default.sessions) == len(scoped.sessions) == 2  # one group each, never merged
    # the audit of the experiment re-scores with the registry's stack and finds the verdict right
    report = await audit(
        cfg, AuditOptions(experiment="exp-a", groups=[gid], progress=False), stdout=io.StringIO(), stderr=io.StringIO()
    )
    assert [s.name for s in report.scope.scorers] == ["slow"]
    assert (report.counts["identical"], report.exit_code) == (1, 0), report.counts


async def test_removing_an_experiment_lets_its_open_group_finish_then_stops_serving_it(pipeline_config) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    gid = f"open-{uuid.uuid4().hex[:6]}"
    first, second = make_group(gid, 2)
    async with running_worker(cfg, "w-fleet-remove") as worker:
        await _declare(cfg, _spec("exp-r", LENGTH, group_timeout_s=8.0))
        await _serving(worker, "exp-r")
        await _publish(cfg, "exp-r", [first])
        await publish_removal(cfg, "exp-r")
        await eventually(
            lambda: worker.fleet.get("exp-r").retire_at is not None,
            timeout_s=10,
            what="the removal to reach the worker (retiring)",
        )
        await _publish(cfg, "exp-r", [second])  # the open group's last member is still scored
        finished = (await _verdicts(cfg, "exp-r", {gid}))[gid]
        await _serving(worker, "exp-r", present=False)  # after its group timeout: no longer served
    assert finished.status == "accepted" and len(finished.sessions) == 2, finished.reason


async def test_a_flooded_experiment_does_not_stall_another(pipeline_config) -> None:
    """A holds every slot with a backlog; B's records, published then, take the slots A frees
    first (B is under its fair share, A over it). Counted in records A started while B was
    being served, not in seconds: without fair sharing A wins most freed slots (its four
    partitions against B's one) and started 27 in a run here, 8 with it."""
    cfg = with_scorers(pipeline_config, _slow(0.2), concurrency=8)

    def started(worker, experiment_id: str) -> float:
        return worker.telemetry.experiment_records.labels(experiment_id, "ready")._value.get()

    async with running_worker(cfg, "w-fleet-fair") as worker:
        await _declare(cfg, _spec("exp-flood", _slow(0.2)))
        await _declare(cfg, _spec("exp-calm", _slow(0.2)))
        await _serving(worker, "exp-flood")
        await _serving(worker, "exp-calm")
        flood = [m for g in range(80) for m in make_group(f"flood-{g}-{uuid.uuid4().hex[:4]}", 1)]
        calm = [m for g in range(5) for m in make_group(f"calm-{g}-{uuid.uuid4().hex[:4]}", 1)]
        await _publish(cfg, "exp-flood", flood)
        await eventually(
            lambda: len(worker.fleet.get("exp-flood").in_flight) >= 6,
            timeout_s=20,
            interval_s=0.01,
            what="A to hold the worker (all but the reserve)",
        )
        before = started(worker, "exp-flood")
        await _publish(cfg, "exp-calm", calm)
        await _verdicts(cfg, "exp-calm", {m.group_id for m in calm})
        meanwhile = started(worker, "exp-flood") - before
    assert meanwhile <= 15, f"A started {meanwhile:.0f} records while B's 5 waited for slots"


async def test_an_experiments_quota_caps_its_records_in_flight(pipeline_config) -> None:
    cfg = with_scorers(pipeline_config, LENGTH, concurrency=16)
    async with running_worker(cfg, "w-fleet-quota") as worker:
        await _declare(cfg, _spec("exp-capped", _slow(0.03), max_in_flight=2))
        await _serving(worker, "exp-capped")
        groups = [m for g in range(30) for m in make_group(f"cap-{g}-{uuid.uuid4().hex[:4]}", 1)]
        await _publish(cfg, "exp-capped", groups)
        capped = worker.fleet.get("exp-capped")
        most, done = 0, asyncio.create_task(_verdicts(cfg, "exp-capped", {m.group_id for m in groups}))
        while not done.done():
            most = max(most, len(capped.in_flight))
            await asyncio.sleep(0.005)
        await done
    assert 1 <= most <= 2


async def test_an_experiments_trainer_shapes_as_its_declaration_says(pipeline_config, tmp_path) -> None:
    from infra.config import PRMAdvantageShapingConfig
    from infra.experiments import UnknownExperiment
    from prm_pipeline.demo.processes import write_config
    from shaper.trainer import _configure

    cfg = with_scorers(pipeline_config, LENGTH)
    config = write_config(cfg, tmp_path / "config.yaml")
    shaping = PRMAdvantageShapingConfig(mode="gvpo", negative_scale=0.5)
    await _declare(
        cfg, ExperimentSpec(experiment_id="exp-shaped", prm=PRMConfig(scorers=[LENGTH], advantage_shaping=shaping))
    )

    def args(experiment: str, mode: str | None = None) -> argparse.Namespace:
        return argparse.Namespace(
            config=str(config),
            experiment=experiment,
            mode=mode,
            batch_groups=None,
            device=None,
            filter=None,
            exclude_neutral_turns=None,
            combined_mode=None,
        )

    loaded = await asyncio.to_thread(_configure, args("exp-shaped"))
    assert loaded.prm.advantage_shaping == shaping and loaded.trainer.experiment == "exp-shaped"
    overridden = await asyncio.to_thread(_configure, args("exp-shaped", "additive"))
    assert overridden.prm.advantage_shaping.mode == "additive"
    assert overridden.prm.advantage_shaping.negative_scale == 0.5  # the declared coefficients stay
    with pytest.raises(UnknownExperiment, match="no declaration"):
        await asyncio.to_thread(_configure, args("exp-undeclared"))


async def test_an_experiment_without_its_topics_is_reported_and_does_not_stop_the_worker(
    pipeline_config, caplog
) -> None:
    """Topics are never auto-created, so a declaration whose topics are missing (written to the
    registry without `experiment add`) leaves them missing: the worker says so and serves the rest."""
    cfg = with_scorers(pipeline_config, LENGTH)
    await publish_spec(cfg, _spec("exp-bare", LENGTH))  # no topics made for it
    missing = trajectories_topic(cfg.topics.trajectories, "exp-bare")
    started = time.monotonic()
    async with running_worker(cfg, "w-bare") as worker:
        assert time.monotonic() - started < 15  # not the consumer's 30 s wait, then a crash
        assert worker.fleet.get("exp-bare") is not None
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_many(make_group("g-bare", 1, turns=1, output_tokens=2))
        (verdict,) = await wait_for_verdicts(cfg, ["g-bare"], timeout_s=30)
        assert verdict.status == "accepted"
    assert f"topic {missing!r} does not exist" in caplog.text
    assert missing not in set(await _topic_names(cfg))


async def _topic_names(cfg: PipelineConfig) -> list[str]:
    from infra.kafka import make_admin

    admin = make_admin(cfg.kafka)
    await admin.start()
    try:
        return await admin.list_topics()
    finally:
        await admin.close()
