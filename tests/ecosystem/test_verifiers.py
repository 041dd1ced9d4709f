"""The verifiers integration against real verifiers 0.4.0: ``Task.score`` runs the PRM reward through the pipeline.

Traces are built the way verifiers records a rollout (``MessageNode``s with token ids,
the sampled mask and log-probs; a tool result between two model turns) and scored
with verifiers' own ``Task.score``; two worker processes score the published samples
with ``TokenParityScorer`` (+0.5 for an even token id, -0.25 for an odd one), so every
expected number below is worked out by hand.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import verifiers.v1 as vf
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.types import AssistantMessage, ToolMessage, UserMessage

from infra.config import PipelineConfig
from infra.kafka import ensure_topics
from shaper.integrations.verifiers import PRMRewardMixin, close_clients, trace_sample
from tests.ecosystem.parity import parity_config
from tests.integration.harness import isolated_config, worker_processes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    return parity_config("vf", kafka_bootstrap, redis_url)


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("vf-workers")) as procs:
        yield procs


def two_turn_trace(task: vf.Task, answer: list[int]) -> Trace:
    """user [1 2 3] | assistant scaffold [9] + sampled [4 5] | tool [7 7] | assistant scaffold [9] + sampled ``answer``."""
    nodes = [
        MessageNode(parent=None, message=UserMessage(content="what is 2+2?"), token_ids=[1, 2, 3], mask=[False] * 3),
        MessageNode(
            parent=0,
            message=AssistantMessage(content="let me check"),
            sampled=True,
            token_ids=[9, 4, 5],
            mask=[False, True, True],
            logprobs=[-0.1, -0.2],
        ),
        MessageNode(
            parent=1, message=ToolMessage(content="4", tool_call_id="c1"), token_ids=[7, 7], mask=[False, False]
        ),
        MessageNode(
            parent=2,
            message=AssistantMessage(content="the answer is 4"),
            sampled=True,
            token_ids=[9, *answer],
            mask=[False] + [True] * len(answer),
            logprobs=[-0.3] * len(answer),
        ),
    ]
    return Trace(
        task=TraceTask(type=type(task).__name__, data=task.data), agent=AgentInfo(config=AgentConfig()), nodes=nodes
    )


def mean_parity(ids: list[int]) -> float:
    return sum(0.5 if i % 2 == 0 else -0.25 for i in ids) / len(ids)


def make_task(cfg: PipelineConfig, **attrs) -> vf.Task:
    class MathTask(PRMRewardMixin, vf.Task):
        prm_config = cfg
        prm_verdict_timeout_s = 60.0

        def prm_outcome(self, task, trace) -> float:
            return 1.0 if "4" in trace.last_reply else 0.0

        @vf.reward(weight=2.0)
        async def correct(self, trace) -> float:
            return 1.0 if "4" in trace.last_reply else 0.0

    for name, value in attrs.items():
        setattr(MathTask, name, value)
    return MathTask(vf.TaskData(prompt="what is 2+2?"))


async def test_task_score_writes_turn_rewards_and_the_process_reward(cfg, workers) -> None:
    task = make_task(cfg)
    trace = two_turn_trace(task, [6, 8, 11])
    try:
        await task.score(trace)
    finally:
        await close_clients()
    assert trace.info["prm"]["status"] == "accepted" and trace.info["prm"]["reason_code"] == "", trace.info["prm"]
    # Turn 1 sampled [4, 5]; turn 2 sampled [6, 8, 11] (scaffold and tool tokens are not the model's).
    assert trace.info["turn_rewards"] == pytest.approx([mean_parity([4, 5]), mean_parity([6, 8, 11])])
    process = mean_parity([4, 5, 6, 8, 11])  # the mean over every generated token
    assert trace.rewards["prm_process"].score == pytest.approx(process)
    assert trace.rewards["correct"].score == 1.0
    assert trace.reward == pytest.approx(process + 2.0)  # verifiers sums the weighted rewards
    assert trace.info["prm"]["outcome"] == 1.0


async def test_a_rollout_group_is_scored_together(cfg, workers) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    task = make_task(cfg, prm_group=lambda self, task, trace: (group, 2), prm_reduction="sum")
    traces = [two_turn_trace(task, [6]), two_turn_trace(task, [3, 5])]
    try:
        await asyncio.gather(*(task.score(t) for t in traces))
    finally:
        await close_clients()
    assert [t.info["prm"]["group_id"] for t in traces] == [group, group]
    assert [t.info["prm"]["status"] for t in traces] == ["accepted", "accepted"]
    assert traces[0].info["turn_rewards"] == pytest.approx([0.125, 0.5])
    assert traces[1].info["turn_rewards"] == pytest.approx([0.125, -0.25])
    assert traces[0].rewards["prm_process"].score == pytest.approx(0.5 - 0.25 + 0.5)
    assert traces[1].rewards["prm_process"].score == pytest.approx(0.5 - 0.25 - 0.25 - 0.25)


async def test_a_late_verdict_records_no_process_reward(kafka_bootstrap, redis_url) -> None:
    """No workers on this config: nothing is made up — the reward is absent and the trace says why."""
    cfg = isolated_config(f"vf-late-{uuid.uuid4().hex[:8]}", kafka_bootstrap, redis_url)
    await ensure_topics(cfg.kafka, cfg.topics)
    task = make_task(cfg, prm_verdict_timeout_s=1.0)
    trace = two_turn_trace(task, [6])
    try:
        await task.score(trace)
    finally:
        await close_clients()
    assert "prm_process" not in trace.rewards
    assert trace.info["prm"]["status"] == "timeout"
    assert trace.info["turn_rewards"] == [None, None]
    assert trace.reward == 2.0  # the task's own reward only

    strict = make_task(cfg, prm_verdict_timeout_s=1.0, prm_on_timeout="raise")
    try:
        with pytest.raises(vf.TaskError, match="no verdict"):
            await strict.score(two_turn_trace(strict, [6]))
    finally:
        await close_clients()


def test_trace_sample_lays_out_prompt_turns_and_text() -> None:
    task = make_task(PipelineConfig())
    sample, positions, texts = trace_sample(two_turn_trace(task, [6, 8]), outcome=1.0)
    assert list(sample.prompt_ids) == [1, 2, 3, 9]
    assert list(sample.response_ids) == [4, 5, 7, 7, 9, 6, 8]
    assert list(sample.response_mask) == [1, 1, 0, 0, 0, 1, 1]
    assert list(sample.response_logprobs) == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.3, -0.3])
    assert positions == [[0, 1], [5, 6]]
    assert sample.messages == [{"role": "user", "content": "what is 2+2?"}]
    assert texts == {(4, 5): "let me check", (7, 7, 9): "4", (6, 8): "the answer is 4"}
