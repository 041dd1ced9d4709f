"""OpenClaw-RL's online mode end to end: ``run_trainer`` with ``recipe: openclaw_turns`` and
``trainer.online_samples`` against a real worker, broker and redis-server. A streamed
session's turns train while the session is still open, decided by OpenClaw-RL's
per-session rule; its verdict trains only the members that were not streamed; a
redelivered sample trains once; a failed step leaves its samples for redelivery."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest

from infra.config import PipelineConfig, TrainerConfig
from infra.experiments import turn_samples_topic
from infra.kafka import ensure_topics, make_producer
from infra.schema import TurnSample, decode_turn_sample, encode, pack_array, stream_session
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from producers.publisher import TrajectoryPublisher
from shaper import TrainingBatch, run_trainer
from shaper.online import TurnSampleReader
from shaper.trainer import ShapedBatch, StepReport, TrainerSummary
from tests.integration.harness import isolated_config, read_topic, running_worker
from tests.integration.test_streaming import config, session
from tests.polling import eventually
from tests.unit.test_online import upstream

pytestmark = pytest.mark.integration

JUDGE_LATENCY_S = 0.3


@pytest.fixture(scope="module")
def judge():
    with FakeJudgeServer(latency_ms=JUDGE_LATENCY_S * 1000) as server:
        yield server


def online(cfg: PipelineConfig, **trainer: Any) -> PipelineConfig:
    """``cfg`` with an online trainer of its own (group, one sample or group a step)."""
    trainer = {"batch_groups": 1, "device": "cpu", **trainer}
    tc = TrainerConfig(
        group_id=f"trainer.{cfg.worker.group_id}", recipe="openclaw_turns", online_samples=True, **trainer
    )
    return msgspec.structs.replace(cfg, trainer=tc)


@dataclass
class Steps:
    """What each step trained: its source, rows (trajectory, leaf turn) and per-row advantage."""

    seen: list[dict[str, Any]] = field(default_factory=list)

    def update(self, batch: TrainingBatch, shaped: ShapedBatch) -> dict[str, float]:
        rows = []
        for i, (tid, leaf) in enumerate(zip(batch.trajectory_ids, batch.leaf_ids)):
            kept = shaped.advantages[i][shaped.loss_mask[i]]
            rows.append((tid, leaf, sorted({float(v) for v in kept.tolist()})))
        self.seen.append({"at": time.time(), "rows": rows})
        return {}

    def on_step(self, report: StepReport) -> None:
        self.seen[-1]["source"] = report.source

    def trained(self, source: str, trajectory: str | None = None) -> list[str]:
        return [
            leaf for s in self.seen if s["source"] == source for tid, leaf, _ in s["rows"] if trajectory in (None, tid)
        ]

    def at(self, leaf: str) -> float:
        return next(s["at"] for s in self.seen for _, lf, _ in s["rows"] if lf == leaf)


@contextlib.asynccontextmanager
async def training(cfg: PipelineConfig, steps: Steps, **kwargs: Any) -> AsyncIterator[list[TrainerSummary]]:
    """``run_trainer`` in the background, stopped (and its summary given) on exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_trainer(cfg, stop=stop, update=steps.update, on_step=steps.on_step, **kwargs))
    out: list[TrainerSummary] = []
    try:
        yield out
    finally:
        stop.set()
        out.append(await asyncio.wait_for(task, 60))


def sample(tid: str, k: int, score: float, *, has_next: bool = True, last: bool = False) -> TurnSample:
    return TurnSample(
        session_id=f"s-{tid}",
        trajectory_id=tid,
        group_id=f"g-{tid}",
        interaction_id=f"{tid}-{k}",
        turn=k + 1,
        scorer="openclaw_judge",
        score=score,
        has_next_state=has_next,
        last=last,
        prompt_tokens_raw=pack_array([1, 2, 3], np.dtype("<i4")),
        output_tokens_raw=pack_array([4, 5], np.dtype("<i4")),
        judged_at=time.time(),
    )


async def send(cfg: PipelineConfig, samples: list[TurnSample]) -> None:
    """Publish ``samples`` as the workers do (keyed by session)."""
    topic = turn_samples_topic(cfg.topics.turn_samples, "default")
    await ensure_topics(cfg.kafka, cfg.topics, [topic])
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for s in samples:
            value, headers = encode(s)
            await producer.send_and_wait(topic, value, key=s.session_id.encode(), headers=headers)
    finally:
        await producer.stop()


def direct_config(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return online(isolated_config(f"online-{uuid.uuid4().hex[:8]}", kafka_bootstrap, redis_url, partitions=1))


async def test_online_mode_trains_turns_while_the_session_is_open(kafka_bootstrap, redis_url, judge) -> None:
    """A group of a streamed member and a ready one. Each streamed turn trains one judge call
    after its next state arrived, long before the end, as OpenClaw-RL decides (a leading
    neutral turn kept, a later one not, a negative one kept); at the end the verdict trains
    only the ready member (the streamed one's turns were trained already)."""
    cfg = online(config(kafka_bootstrap, redis_url, judge, turn_samples=True))
    rng = np.random.default_rng(7)
    traj = session(
        "online", "gmix", 2, rng, branch=False, replies=["hmm", "ok, success", "hmm", "error: wrong file", "thanks"]
    )  # judged 0, +1, 0, -1, +1; the 6th turn has no next state
    ready = session("ready", "gmix", 2, rng, turns=3, branch=False)
    turns, end = stream_session(traj)
    steps = Steps()
    published: dict[str, float] = {}  # turn -> when its next state (the next turn) was published
    # An agent: its next turn comes after the judge answered the last (an observer in a group
    # of its own sees each sample), so samples arrive in turn order, as upstream's do.
    observer = TurnSampleReader(
        msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, group_id="observer"))
    )
    await observer.start()
    async with running_worker(cfg, "w1"), training(cfg, steps) as summary:
        await send(cfg, [sample("warm", 0, 1.0)])  # the trainer has joined its group once this trained
        await eventually(lambda: steps.trained("turn_samples"), timeout_s=30, what="the warm-up sample trained")
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            await pub.publish_ready(ready)
            seen: list[Any] = []
            for k, turn in enumerate(turns):
                await pub.publish_turn(turn)
                await pub.flush()
                if k:
                    published[turns[k - 1].interaction.interaction_id] = time.time()
                    while len(seen) < k:
                        seen += await eventually(observer.batch, timeout_s=30, what=f"turn {k - 1}'s sample")
            await observer.aclose()
            await eventually(
                lambda: (
                    set(steps.trained("turn_samples", "online")) >= {"online-0", "online-1", "online-3", "online-4"}
                ),
                timeout_s=60,
                what=lambda: f"the open session's turns trained (so far {steps.trained('turn_samples', 'online')})",
            )
            assert steps.trained("verdicts") == []  # no verdict yet: the session is open
            await pub.end_session(end)
        await eventually(
            lambda: steps.trained("verdicts"), timeout_s=60, what="the group's verdict reaches the trainer"
        )
    records = await read_topic(cfg, turn_samples_topic(cfg.topics.turn_samples, "default"))
    samples = [s for s in (decode_turn_sample(r.value, r.headers) for r in records) if s.trajectory_id == "online"]
    (totals,) = summary
    metrics = totals.metrics

    # OpenClaw-RL's proxy on the same samples, in arrival order, keeps exactly what trained.
    keep = upstream([(s.score, s.has_next_state, s.last) for s in samples])
    trained = steps.trained("turn_samples", "online")
    assert sorted(trained) == sorted(s.interaction_id for s, k in zip(samples, keep) if k)
    assert sorted(trained) == ["online-0", "online-1", "online-3", "online-4"]
    advantages = {leaf: adv for s in steps.seen for tid, leaf, adv in s["rows"] if tid == "online"}
    assert advantages == {"online-0": [0.0], "online-1": [1.0], "online-3": [-1.0], "online-4": [1.0]}
    # The verdict: the streamed member is left out (trained online), the ready one trains.
    assert {tid for s in steps.seen if s["source"] == "verdicts" for tid, _, _ in s["rows"]} == {"ready"}
    assert metrics["pipeline/members/trained_online"] == 1
    assert metrics["pipeline/turn_samples/excluded"] == 2  # online-2 (neutral, not first) and the last turn
    assert metrics["pipeline/turn_samples/rescued"] == 1
    # Latency: next state published -> the trainer stepped on the turn's sample (one judge call).
    latency = {leaf: steps.at(leaf) - published[leaf] for leaf in ("online-1", "online-3", "online-4")}
    judged = {
        s.interaction_id: s.judged_at - published[s.interaction_id] for s in samples if s.interaction_id in latency
    }
    print(
        f"\nonline sample latency, next state -> trained (judge {JUDGE_LATENCY_S}s, m=3): "
        + ", ".join(f"{k} {v:.3f}s (judged after {judged[k]:.3f}s)" for k, v in latency.items())
    )
    assert all(latency[k] - judged[k] < 0.5 for k in latency), (latency, judged)  # the pipeline's own share


async def test_a_redelivered_sample_trains_once(kafka_bootstrap, redis_url) -> None:
    """A worker that sends a session's samples again (it took the session over) does not
    train a turn twice; after the run committed, a new trainer in the group reads nothing."""
    cfg = direct_config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    first = [sample("t", 0, 0.0), sample("t", 1, 1.0), sample("t", 2, 0.0)]
    await send(cfg, [*first, *first[:2], sample("t", 3, 0.0, has_next=False, last=True)])
    steps = Steps()
    summary = await run_trainer(cfg, idle_timeout_s=3.0, update=steps.update, on_step=steps.on_step)
    assert steps.trained("turn_samples") == ["t-0", "t-1"]  # t-0 rescued, t-2 and the last excluded
    assert summary.metrics["pipeline/turn_samples/duplicate"] == 2
    again = Steps()
    summary = await run_trainer(cfg, idle_timeout_s=3.0, update=again.update, on_step=again.on_step)
    assert again.seen == [] and summary.steps == 0


async def test_a_failed_step_leaves_its_samples_for_redelivery(kafka_bootstrap, redis_url) -> None:
    """Nothing is committed before the step that used it is done: a step that fails leaves
    its sample (and everything after it) to the next trainer of the group."""
    cfg = direct_config(kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    await send(cfg, [sample("u", 0, 1.0), sample("u", 1, -1.0), sample("u", 2, 1.0)])
    steps = Steps()

    def failing(batch: TrainingBatch, shaped: ShapedBatch) -> dict[str, float]:
        if "u-1" in batch.leaf_ids:
            raise RuntimeError("optimiser step failed")
        return steps.update(batch, shaped)

    with pytest.raises(RuntimeError, match="optimiser step failed"):
        await run_trainer(cfg, idle_timeout_s=3.0, update=failing, on_step=steps.on_step)
    assert steps.trained("turn_samples") == ["u-0"]
    again = Steps()
    await run_trainer(cfg, idle_timeout_s=3.0, update=again.update, on_step=again.on_step)
    assert again.trained("turn_samples") == ["u-1", "u-2"]
