"""One experiment id end to end outside the worker, on the real broker.

Producers publish to the experiment's trajectories topic; the trainer's consumer, the
reward client and ``verdicts`` read only the experiment's verdicts topic and keep two
experiments' groups of the same id apart. Verdicts are hand-built (or scored in-process by
a stand-in for the worker) and published straight to the verdict topics, so nothing here
depends on the workers' fleet code.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import msgspec
import pytest

from infra import jsonl
from infra.config import PipelineConfig, PRMConfig, PRMScorerConfig
from infra.experiments import trajectories_topic, verdicts_topic
from infra.kafka import ensure_topics, make_producer
from infra.readback import reference
from infra.registry import ExperimentSpec, publish_spec
from infra.schema import GroupVerdict, decode_message, encode
from prm_pipeline.audit import rescore
from prm_pipeline.cli import main
from prm_pipeline.demo.processes import write_config
from prm_pipeline.demo.synthetic import make_group
from prm_pipeline.verdict_dump import DumpCounts, _dump
from producers.publisher import TrajectoryPublisher
from scoring_workers.prm import PRMRunner
from scoring_workers.scorers import LengthBudgetScorer
from shaper import VerdictConsumer
from shaper.reward_client import RewardClient, Sample
from tests.integration.harness import read_topic
from tests.integration.test_verdict_consumer import collect, drain_until, trainer_config
from tests.unit.test_batch import accepted_group

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0


async def topics_of(cfg: PipelineConfig, *experiments: str) -> None:
    """The experiments' topics, and their declarations (publishers and waiters refuse an undeclared one)."""
    names = [cfg.topics.trajectories, cfg.topics.verdicts]
    for exp in experiments:
        names += [trajectories_topic(cfg.topics.trajectories, exp), verdicts_topic(cfg.topics.verdicts, exp)]
    await ensure_topics(cfg.kafka, cfg.topics, names)
    for exp in experiments:
        await publish_spec(
            cfg,
            ExperimentSpec(
                experiment_id=exp,
                prm=PRMConfig(scorers=[PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer")]),
            ),
        )


async def send(cfg: PipelineConfig, topic: str, verdicts: list[GroupVerdict], *, key: str | None = None) -> None:
    """Publish verdicts to ``topic`` as a worker would (keyed by group, or all by ``key``: one partition, in order)."""
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for v in verdicts:
            value, headers = encode(v)
            await producer.send(topic, value, key=(key or v.group_id).encode(), headers=headers)
        await producer.flush()
    finally:
        await producer.stop()


def of(experiment: str, verdict: GroupVerdict) -> GroupVerdict:
    return msgspec.structs.replace(verdict, experiment_id=experiment)


async def test_publishers_write_to_their_experiments_topic(pipeline_config, tmp_path, capsys) -> None:
    cfg = pipeline_config
    await topics_of(cfg, "exp-a")
    (t1,) = make_group("g1", 1, turns=1, output_tokens=2)
    async with TrajectoryPublisher(cfg.kafka, cfg.topics, experiment="exp-a") as pub:
        await pub.publish_ready(t1)
        await pub.discard_group("g1", "env crashed")
    # the command line: lines that name no experiment are stamped; one naming another is refused, nothing sent
    (t2,) = make_group("g2", 1, turns=1, output_tokens=2)
    jsonl.write(tmp_path / "in.jsonl", [t2])
    (tmp_path / "other.jsonl").write_text(
        (tmp_path / "in.jsonl").read_text()
        + json.dumps({"kind": "discard", "group_id": "g3", "experiment_id": "exp-b"})
    )
    config = write_config(cfg, tmp_path / "config.yaml")

    async def cli(*args: str) -> int:  # in-process (its own event loop in a thread): no interpreter start-up
        return await asyncio.to_thread(main, ["--config", str(config), "publish", "-q", *args])

    assert await cli("--experiment", "exp-a", str(tmp_path / "in.jsonl")) == 0
    assert capsys.readouterr().out.strip().endswith(f"to {cfg.topics.trajectories}.exp-a")
    assert await cli("--experiment", "exp-a", str(tmp_path / "other.jsonl")) == 1
    assert "names experiment 'exp-b'" in capsys.readouterr().err

    records = await read_topic(
        cfg,
        trajectories_topic(cfg.topics.trajectories, "exp-a"),
        until=time.monotonic() + DEADLINE_S,
        stop_when=lambda rs: len(rs) >= 3,
    )
    messages = [decode_message(r.value, r.headers) for r in records]
    assert sorted((type(m).__name__, m.group_id, m.experiment) for m in messages) == [
        ("DiscardGroup", "g1", "exp-a"),
        ("ReadyTrajectory", "g1", "exp-a"),
        ("ReadyTrajectory", "g2", "exp-a"),
    ]
    assert await read_topic(cfg, cfg.topics.trajectories) == []  # the default experiment's topic got nothing


async def test_trainers_of_two_experiments_keep_the_same_group_ids_apart(
    pipeline_config, unique_name, tmp_path, caplog
) -> None:
    cfg = trainer_config(pipeline_config, unique_name, batch_groups=1)
    await topics_of(cfg, "exp-a", "exp-b")
    topic_a, topic_b = (verdicts_topic(cfg.topics.verdicts, e) for e in ("exp-a", "exp-b"))
    g1_a, g1_b = of("exp-a", accepted_group("g1")), of("exp-b", accepted_group("g1"))
    misplaced = of("exp-b", accepted_group("g-wrong"))  # experiment B's verdict on A's topic
    await send(cfg, topic_a, [g1_a, misplaced, g1_a])  # g1 of A twice: a re-published verdict
    await send(cfg, topic_b, [g1_b])
    store = tmp_path / "dedupe.sqlite"  # one durable store shared by both trainers

    consumer_a = VerdictConsumer(cfg, experiment="exp-a", dedupe_store=store)
    assert (consumer_a.topic, consumer_a.group_id) == (topic_a, f"{cfg.trainer.group_id}.exp-a")
    async with consumer_a:
        (batch,) = await collect(consumer_a, 1)
        assert batch.group_ids == ["g1", "g1"]
        await drain_until(consumer_a, "verdicts/duplicate", 1)
        await drain_until(consumer_a, "verdicts/wrong_experiment", 1)
    assert consumer_a.wrong_experiment == 1
    warnings = [r.getMessage() for r in caplog.records if "g-wrong" in r.getMessage()]
    assert len(warnings) == 1 and "experiment 'exp-b'" in warnings[0] and "trains experiment 'exp-a'" in warnings[0]

    # B's g1 v1 has A's (group_id, verdict_version): with the experiment in the key it is not a duplicate
    async with VerdictConsumer(cfg, experiment="exp-b", dedupe_store=store) as consumer_b:
        (batch,) = await collect(consumer_b, 1)
        assert batch.group_ids == ["g1", "g1"]
        assert consumer_b.totals().get("pipeline/verdicts/duplicate", 0) == 0


async def test_reward_client_and_verdicts_dump_of_one_experiment(pipeline_config) -> None:
    """A RewardClient of experiment A publishes to A's topic and gets A's verdict, whose
    members' tokens are read back from A's trajectories topic; a verdict of the same group
    id of experiment B, on B's topic or misplaced on A's, never answers it."""
    cfg = msgspec.structs.replace(
        pipeline_config, trainer=msgspec.structs.replace(pipeline_config.trainer, experiment="exp-a")
    )  # the client's default: trainer.experiment
    await topics_of(cfg, "exp-a", "exp-b")
    traj_a, topic_a = trajectories_topic(cfg.topics.trajectories, "exp-a"), verdicts_topic(cfg.topics.verdicts, "exp-a")
    decoy = GroupVerdict(
        group_id="g1",
        status="rejected",
        reason="not yours",
        reason_code="missing_sessions",
        verdict_version=1,
        group_size=1,
        experiment_id="exp-b",
    )
    await send(cfg, verdicts_topic(cfg.topics.verdicts, "exp-b"), [decoy])

    async def stand_in_worker() -> None:
        """Scores what arrives on A's topic and publishes a reference-form verdict to A's verdicts topic."""
        records = await read_topic(cfg, traj_a, until=time.monotonic() + DEADLINE_S, stop_when=lambda rs: len(rs) >= 1)
        (record,) = records
        traj = decode_message(record.value, record.headers)
        assert traj.experiment == "exp-a"
        runner = await PRMRunner.create(PRMConfig(scorers=[LengthBudgetScorer(max_output_tokens=8)]))  # type: ignore[list-item]
        try:
            member = reference(await rescore(runner, traj, timeout_s=10), record.partition, record.offset)
            infos = runner.scorer_infos()
        finally:
            await runner.aclose()
        verdict = GroupVerdict(
            group_id="g1",
            status="accepted",
            verdict_version=1,
            group_size=1,
            sessions=[member],
            scorers=infos,
            worker_id="stand-in",
            experiment_id="exp-a",
        )
        await send(cfg, topic_a, [msgspec.structs.replace(decoy, experiment_id="exp-b"), verdict], key="g1")

    worker = asyncio.create_task(stand_in_worker())
    async with RewardClient(cfg, verdict_timeout_s=DEADLINE_S) as client:
        assert client.experiment == "exp-a"
        (reward,) = await client.score_group([Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7])], group_id="g1")
    await worker
    assert reward.status == "accepted", reward.reason
    assert reward.verdict is not None and reward.verdict.sessions[0].turns  # read back from A's topic
    assert len(reward.token_rewards) == 4

    out, counts = io.StringIO(), DumpCounts()
    await _dump(cfg, out, from_beginning=True, max_count=1, timeout_s=DEADLINE_S, counts=counts, experiment="exp-a")
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert (line["group_id"], line["status"], line["experiment_id"]) == ("g1", "accepted", "exp-a")
    assert counts.other_experiment == 1 and "1 verdicts of another experiment" in counts.summary()
