"""The reward gateway over real HTTP, against the embedded broker and Redis and a real worker.

Every route answers in its caller's shape, and every error path has its status: 400
naming the field (msgspec's path, ``$.samples[0].response_ids[0]``), 413, 429 with
Retry-After, 504 naming the group, and a rejected group as 200 with its status, reason
code and reason.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from infra.config import GatewayConfig, PipelineConfig, PRMScorerConfig
from infra.kafka import ensure_topics
from prm_pipeline.gateway import serve
from tests.integration.harness import isolated_config, running_worker
from tests.polling import eventually

pytestmark = pytest.mark.integration

BUDGET = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 1000})


@contextlib.asynccontextmanager
async def gateway(cfg: PipelineConfig, **gw: Any) -> AsyncIterator[str]:
    """A gateway on a free loopback port; yields its base URL."""
    cfg = msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, port=0, **gw))
    await ensure_topics(cfg.kafka, cfg.topics)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(cfg, stop, on_ready=ready.set_result))
    try:
        port = await asyncio.wait_for(asyncio.shield(ready), 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def post(
    url: str, body: Any = None, *, data: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, json=body if data is None else None, data=data, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None), dict(r.headers)


@pytest.fixture
def cfg(kafka_bootstrap: str, redis_url: str, unique_name: str) -> PipelineConfig:
    return isolated_config(unique_name, kafka_bootstrap, redis_url, scorers=[BUDGET])


async def test_openrlhf_slime_and_native_routes_return_process_rewards(cfg) -> None:
    async with running_worker(cfg, "w-gw"), gateway(cfg) as url:
        # OpenRLHF: query = prompt + response, one scalar per query (mean token reward here)
        status, body, _ = await post(
            f"{url}/openrlhf",
            {"query": ["Q: 2+2? A: 4", "Q: hi A: hello"], "prompts": ["Q: 2+2? A:", "Q: hi A:"], "labels": ["4", ""]},
        )
        assert status == 200, body
        assert body["rewards"] == [1.0, 1.0] and body["scores"] == [1.0, 1.0]
        assert body["status"] == ["accepted", "accepted"] and body["reason_code"] == ["", ""]
        assert body["extra_logs"]["prm_process"] == [1.0, 1.0] and body["extra_logs"]["prm_outcome"] == [0.0, 0.0]

        # slime: a message-list prompt; token_rewards lie on the response's tokens (UTF-8 bytes)
        status, body, _ = await post(
            f"{url}/slime", {"prompt": [{"role": "user", "content": "say hi"}], "response": "hié", "label": None}
        )
        assert status == 200, body
        assert body["status"] == "accepted" and body["score"] == 1.0 and body["reason_code"] == ""
        assert body["token_rewards"] == [1.0] * len("hié".encode())

        # native: token ids, two turns marked by response_mask, a whole group of two
        samples = [
            {
                "prompt_ids": [1, 2, 3],
                "response_ids": [10, 11, 50, 51, 12],
                "response_mask": [1, 1, 0, 0, 1],
                "response_logprobs": [-0.1] * 5,
                "outcome_reward": 1.0,
            },
            {"prompt_ids": [1, 2, 3], "response_ids": [20, 21], "outcome_reward": 0.0},
        ]
        status, body, _ = await post(f"{url}/v1/score", {"samples": samples})
        assert status == 200, body
        assert body["status"] == "accepted" and body["reason_code"] == ""
        first, second = body["samples"]
        assert first["token_rewards"] == [1.0, 1.0, 0.0, 0.0, 1.0]  # nothing on the tool tokens
        assert first["turn_rewards"] == [1.0, 1.0] and first["outcome"] == 1.0
        assert second["token_rewards"] == [1.0, 1.0] and second["outcome"] == 0.0


async def test_bad_input_gets_400_naming_the_field_and_big_bodies_413(cfg) -> None:
    async with gateway(cfg, max_body_bytes=2048, max_items=2) as url:
        cases = [
            ({"query": "x", "prompts": ["x"]}, "/openrlhf", "Expected `array`, got `str` - at `$.query`"),
            ({"query": ["ab"], "prompts": ["x"]}, "/openrlhf", "query[0] does not start with prompts[0]"),
            ({"query": ["a", "b", "c"], "prompts": ["a", "b", "c"]}, "/openrlhf", "over the limit of 2"),
            ({"query": ["ab", "c"], "prompts": ["a"]}, "/openrlhf", "`prompts` has 1 items for 2 queries"),
            ({"query": ["ab"], "prompts": ["a"], "labels": []}, "/openrlhf", "`labels` has 0 items for 1 queries"),
            ({"prompt": 5, "response": "x"}, "/slime", "Expected `str | array`, got `int` - at `$.prompt`"),
            (
                {"prompt": [{"role": "user"}], "response": "x"},
                "/slime",
                "Object missing required field `content` - at `$.prompt[0]`",
            ),
            (
                {"samples": [{"prompt_ids": [1], "response_ids": [-1]}]},
                "/v1/score",
                "Expected `int` >= 0 - at `$.samples[0].response_ids[0]`",
            ),
            (
                {"samples": [{"prompt_ids": [2**31], "response_ids": [1]}]},
                "/v1/score",
                "Expected `int` <= 2147483647 - at `$.samples[0].prompt_ids[0]`",
            ),
            (
                {"samples": [{"prompt_ids": [1], "response_ids": [2], "response_logprobs": [0.1, 0.2]}]},
                "/v1/score",
                "`response_logprobs` has 2 values for 1 response tokens",
            ),
            (
                {"samples": [{"prompt_ids": [1], "response_ids": [2], "scorers": ["evil.Module"]}]},
                "/v1/score",
                "Object contains unknown field `scorers` - at `$.samples[0]`",
            ),  # a request never carries configuration
            ({"samples": []}, "/v1/score", "Expected `array` of length >= 1 - at `$.samples`"),
            ([1], "/v1/score", "Expected `object`, got `array` - at `$`"),
        ]
        for body, route, expected in cases:
            status, answer, _ = await post(f"{url}{route}", body)
            assert status == 400 and expected in answer["error"], (route, body, answer)
        status, answer, _ = await post(
            f"{url}/v1/score", data=b'{"samples": [{"prompt_ids": [1], "response_ids": [2], "outcome_reward": 1e400}]}'
        )  # not finite
        assert status == 400 and answer["error"] == "Number out of range - at `$.samples[0].outcome_reward`", answer
        status, answer, _ = await post(f"{url}/slime", data=b"{not json", headers={"Content-Type": "application/json"})
        assert status == 400 and answer["error"].startswith("body is not valid JSON (JSON is malformed"), answer
        status, answer, _ = await post(f"{url}/slime", {"prompt": "p", "response": "x" * 4096})
        assert status == 413 and "max_body_bytes=2048" in answer["error"]


async def test_no_verdict_in_time_is_504_naming_the_group_and_busy_is_429(cfg) -> None:
    # no worker runs: the trajectories are published and no verdict comes
    async with gateway(cfg, verdict_timeout_s=3.0, max_in_flight_per_client=1) as url:
        waiting = asyncio.create_task(post(f"{url}/slime", {"prompt": "p", "response": "r"}))
        async with aiohttp.ClientSession() as http:

            async def in_flight() -> bool:  # the first request holds the client's one slot
                async with http.get(f"{url}/metrics") as r:
                    return "prm_gateway_in_flight 1.0" in await r.text()

            await eventually(in_flight, timeout_s=10, what="the first request to get in flight")
        status, body, headers = await post(f"{url}/slime", {"prompt": "p", "response": "r"})
        assert status == 429 and headers.get("Retry-After") == "1", body
        status, body, _ = await waiting
        assert status == 504 and "no verdict for group 'gw-" in body["error"]


async def test_a_rejected_group_is_200_with_its_status_and_reason(kafka_bootstrap, redis_url, unique_name) -> None:
    cfg = isolated_config(
        unique_name,
        kafka_bootstrap,
        redis_url,
        scorers=[PRMScorerConfig("tests.scorers.FailOnMarkerScorer", kwargs={"marker": "FAIL"})],
    )
    cfg = msgspec.structs.replace(cfg, gateway=GatewayConfig())
    async with running_worker(cfg, "w-gw-reject"), gateway(cfg) as url:
        status, body, _ = await post(f"{url}/slime", {"prompt": "please FAIL", "response": "ok"})
    assert status == 200, body
    assert (body["status"], body["reason_code"]) == ("rejected", "scorer_error"), body  # for programs
    assert body["reason"].startswith("scorer_error: member "), body  # for people
    assert body["score"] == 0.0 and body["token_rewards"] == [0.0, 0.0]
