"""The in-process adapters for OpenRLHF (``reward_func``) and slime (custom reward) against
the embedded broker and Redis and a real worker.

OpenRLHF calls ``reward_func`` from worker threads (``asyncio.to_thread``), one query
each; the test does the same, many at once. slime is not installable (the PyPI name
``slime`` is another project), so its samples are built here with the attributes slime's
``Sample`` (``slime/utils/types.py``) has and calls shaped as ``slime/rollout/rm_hub``
makes them: ``await f(args, sample)`` per sample, ``await f(args, samples)`` with
``--group-rm``.

The worker scores with ``TokenParityScorer`` (+0.5 per even token id, -0.25 per odd
one) and ``FailOnMarkerScorer`` (0, or a scorer error for a conversation saying FAIL);
the gateway's tokenizer is ``bytes``, so text tokens are UTF-8 bytes: " 4" is
[32, 52] (0.5, 0.5) and "ab" is [97, 98] (-0.25, 0.5).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from infra.config import PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics
from prm_pipeline.demo.processes import write_config
from shaper.integrations import openrlhf_reward, slime_rm
from tests.integration.harness import TEST_SCORER_MODULES, isolated_config, running_worker

pytestmark = pytest.mark.integration

SCORERS = [
    PRMScorerConfig("tests.ecosystem.scorers.TokenParityScorer"),
    PRMScorerConfig("tests.scorers.FailOnMarkerScorer", kwargs={"marker": "FAIL"}),
]


@pytest.fixture
def cfg(kafka_bootstrap: str, redis_url: str, unique_name: str) -> PipelineConfig:
    cfg = isolated_config(
        unique_name,
        kafka_bootstrap,
        redis_url,
        scorers=SCORERS,
        allowed_scorer_modules=[*TEST_SCORER_MODULES, "tests.ecosystem"],
    )
    return msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, verdict_timeout_s=60.0))


# --------------------------------------------------------------------------- OpenRLHF
async def test_reward_func_from_threads_like_openrlhf(cfg) -> None:
    openrlhf_reward.configure(cfg)
    try:
        async with running_worker(cfg, "w-openrlhf-func"):
            calls = [
                (["Q: 2+2? A: 4"], ["Q: 2+2? A:"], ["4"]),  # response " 4": 0.5, 0.5
                (["Q: letters? ab"], ["Q: letters? "], [""]),  # response "ab": -0.25, 0.5
                (["please FAIL ok"], ["please FAIL"], [""]),
            ]  # the scorer fails: rejected
            answers = await asyncio.gather(*(asyncio.to_thread(openrlhf_reward.reward_func, *c) for c in calls * 3))
        for i, answer in enumerate(answers):
            expected = [[0.5], [0.125], [0.0]][i % 3]
            assert answer["rewards"] == expected and answer["scores"] == expected, (i, answer)
        first, second, rejected = answers[:3]
        assert first["status"] == ["accepted"] and first["extra_logs"] == {
            "prm_outcome": [0.0],
            "prm_process": [0.5],
            "prm_accepted": [1.0],
        }
        assert second["extra_logs"]["prm_process"] == [0.125]
        assert rejected["status"] == ["rejected"] and rejected["reason"][0].startswith("scorer_error")
        assert rejected["reason_code"] == ["scorer_error"]
        assert rejected["extra_logs"]["prm_accepted"] == [0.0]

        with pytest.raises(ValueError, match=r"query\[0\] does not start with prompts\[0\]"):
            await asyncio.to_thread(openrlhf_reward.reward_func, ["xyz"], ["abc"], [""])
    finally:
        await asyncio.to_thread(openrlhf_reward.close)


async def test_reward_func_reduction_and_per_request_grouping_follow_the_config(cfg) -> None:
    cfg = msgspec.structs.replace(
        cfg, gateway=msgspec.structs.replace(cfg.gateway, process_reduction="sum", grouping="per_request")
    )
    openrlhf_reward.configure(cfg)
    try:
        async with running_worker(cfg, "w-openrlhf-sum"):
            answer = await asyncio.to_thread(
                openrlhf_reward.reward_func, ["p: ab", "p: 4", "FAIL: 4"], ["p: ", "p: ", "FAIL: "], None
            )
        # one group of three: the failing member rejects all of it
        assert answer["status"] == ["rejected"] * 3 and answer["rewards"] == [0.0] * 3
        openrlhf_reward.configure(cfg)
        async with running_worker(cfg, "w-openrlhf-sum2"):
            answer = await asyncio.to_thread(openrlhf_reward.reward_func, ["p: ab", "p: 4"], ["p: ", "p: "], None)
        assert answer["status"] == ["accepted"] * 2
        assert answer["rewards"] == [0.25, 0.5]  # sums: -0.25 + 0.5; 0.5 ("4" is 52)
    finally:
        await asyncio.to_thread(openrlhf_reward.close)


# --------------------------------------------------------------------------- slime
class Status(enum.Enum):  # slime's Sample.Status values
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"


@dataclass
class SlimeSample:
    """The attributes of slime's ``Sample`` the custom reward reads (slime/utils/types.py)."""

    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    group_index: int | None = None
    index: int | None = None
    metadata: dict = field(default_factory=dict)


async def test_slime_custom_reward_per_sample_group_and_text(cfg, tmp_path) -> None:
    args = SimpleNamespace(prm_config=str(write_config(cfg, tmp_path / "prm.yaml")), reward_key="score")
    # multi-turn: response [10, 11 | tool 50, 51 | 12]; the tool tokens are masked out
    multi = SlimeSample(
        prompt=[{"role": "user", "content": "add"}],
        tokens=[1, 2, 3, 10, 11, 50, 51, 12],
        response="..",
        response_length=5,
        loss_mask=[1, 1, 0, 0, 1],
        rollout_log_probs=[-0.1] * 5,
        status=Status.COMPLETED,
        group_index=0,
        index=0,
    )
    short = SlimeSample(
        prompt="add",
        tokens=[1, 2, 3, 8],
        response=".",
        response_length=1,
        status=Status.TRUNCATED,
        group_index=0,
        index=1,
    )
    text_only = SlimeSample(prompt="Q: letters?", response="ab", label="ab")
    try:
        async with running_worker(cfg, "w-slime"):
            one = await slime_rm.reward(args, multi)
            group = await slime_rm.reward(args, [multi, short])
            text = await slime_rm.reward(args, text_only)
            ruled = await slime_rm.score_samples(args, [short], outcomes=[1.0])
            failed = await slime_rm.reward(args, SlimeSample(prompt="please FAIL", response="ok"))
    finally:
        await slime_rm.aclose()

    # token rewards on slime's own response tokens: 10 even, 11 odd, tool 0, 12 even
    assert one["status"] == "accepted" and one["token_rewards"] == [0.5, -0.25, 0.0, 0.0, 0.5]
    assert one["turn_rewards"] == [0.125, 0.5]
    assert one["process"] == pytest.approx(0.25) and one["score"] == pytest.approx(0.25)  # mean of 3 generated
    multi.reward = one
    assert multi.reward[args.reward_key] == one["score"]  # what slime's get_reward_value reads

    assert isinstance(group, list) and [g["status"] for g in group] == ["accepted", "accepted"]
    assert group[0]["group_id"] == group[1]["group_id"] != one["group_id"]
    assert group[0]["token_rewards"] == one["token_rewards"] and group[1]["token_rewards"] == [0.5]

    assert text["token_rewards"] == [-0.25, 0.5] and text["score"] == pytest.approx(0.125)
    assert ruled == [{**ruled[0], "outcome": 1.0, "score": 1.5, "process": 0.5}]
    assert failed["status"] == "rejected" and failed["reason"].startswith("scorer_error")
    assert failed["reason_code"] == "scorer_error"
    assert failed["score"] == 0.0 and failed["token_rewards"] == [0.0, 0.0]


async def test_slime_sample_shape_errors_name_the_field(cfg, tmp_path) -> None:
    tokenizer = slime_rm.load_tokenizer("bytes")
    with pytest.raises(ValueError, match="loss_mask has 2 values for response_length 3"):
        slime_rm.sample_from_slime(SlimeSample(tokens=[1, 2, 3, 4], response_length=3, loss_mask=[1, 1]), tokenizer)
    with pytest.raises(ValueError, match="rollout_log_probs has 1 values"):
        slime_rm.sample_from_slime(SlimeSample(tokens=[1, 2], response_length=2, rollout_log_probs=[0.0]), tokenizer)
    with pytest.raises(ValueError, match="sample.prompt must be"):
        slime_rm.sample_from_slime(SlimeSample(prompt=5, response="x"), tokenizer)  # type: ignore[arg-type]
    truncated = slime_rm.sample_from_slime(
        SlimeSample(tokens=[1, 2], response_length=1, status=Status.TRUNCATED), tokenizer
    )
    assert truncated.truncated and list(truncated.prompt_ids) == [1] and list(truncated.response_ids) == [2]


# --------------------------------------------------------------------------- no verdict in time
async def test_no_verdict_in_time_raises_naming_the_group(cfg, tmp_path) -> None:
    cfg = msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, verdict_timeout_s=2.0))
    await ensure_topics(cfg.kafka, cfg.topics)  # and no worker: nothing decides
    openrlhf_reward.configure(cfg)
    try:
        with pytest.raises(openrlhf_reward.VerdictTimeout, match="no verdict for group 'openrlhf-"):
            await asyncio.to_thread(openrlhf_reward.reward_func, ["p: x"], ["p: "], [""])
    finally:
        await asyncio.to_thread(openrlhf_reward.close)
    args = SimpleNamespace(prm_config=str(write_config(cfg, tmp_path / "prm.yaml")))
    try:
        with pytest.raises(slime_rm.VerdictTimeout, match="no verdict for group 'slime-"):
            await slime_rm.reward(args, SlimeSample(prompt="p", response="x"))
    finally:
        await slime_rm.aclose()


async def test_reward_func_with_kafka_unreachable_raises_and_leaves_no_thread(cfg) -> None:
    import socket
    import threading

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap=f"127.0.0.1:{port}"))
    openrlhf_reward.configure(down)
    try:
        for _ in range(2):  # each call tries again; neither leaves its loop thread behind
            with pytest.raises(Exception, match=f"Unable to bootstrap.*{port}"):
                await asyncio.to_thread(openrlhf_reward.reward_func, ["p: x"], ["p: "], [""])
        assert not [t for t in threading.enumerate() if t.name == "prm-openrlhf-reward"]
    finally:
        await asyncio.to_thread(openrlhf_reward.close)
