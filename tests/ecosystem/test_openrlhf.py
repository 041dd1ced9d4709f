"""OpenRLHF's own reward client against the gateway: ``openrlhf/utils/agent.py`` from the real
``openrlhf==0.11.2`` wheel, the embedded broker + Redis and two worker processes.

``make test-ecosystem`` downloads the wheel and extracts ``agent.py``
(``tests/ecosystem/fetch_openrlhf.py``; ``OPENRLHF_AGENT_PY`` names the file). It is
loaded by file path with ``openrlhf.utils.logging_utils`` stubbed, the way OpenRLHF's own
``tests/test_agent.py`` loads it (the package's ``__init__`` would pull torch,
transformers and GPU libraries; the file itself needs only aiohttp).

What is real: ``SingleTurnAgentExecutor.execute`` end to end — it tokenizes the prompt,
calls the engine, decodes prompt + response into ``query`` and posts
``{"query", "prompts", "labels"}`` with its own ``_fetch_rewards_via_http`` (endpoint
rotation, ``raise_for_status``, 5 tries 1 s apart), then reads ``rewards`` / ``scores`` /
``extra_logs`` — and the ``.py`` path, where it loads ``shaper/integrations/openrlhf_reward.py``
by file path and runs its ``reward_func`` in a thread. Written for the test: the
generation engine (fixed token ids) and a byte-level tokenizer with the HF call
signature ``agent.py`` uses, which matches the gateway's ``bytes`` tokenizer.

The workers score with ``TokenParityScorer`` (+0.5 per even token id, -0.25 per odd
one); the reward is the mean over the response's bytes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import uuid
from pathlib import Path
from types import ModuleType, SimpleNamespace

import aiohttp
import msgspec
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from infra.config import PipelineConfig, PRMScorerConfig
from prm_pipeline.demo.processes import write_config
from tests.integration.harness import TEST_SCORER_MODULES, isolated_config, worker_processes
from tests.integration.test_gateway import gateway

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
AGENT_PY = Path(os.environ.get("OPENRLHF_AGENT_PY", ROOT / ".venv-ecosystem" / "openrlhf-0.11.2" / "agent.py"))
REWARD_FUNC_PY = ROOT / "shaper" / "integrations" / "openrlhf_reward.py"


def parity_mean(text: str) -> float:
    """The expected reward: TokenParityScorer's mean over the UTF-8 bytes of ``text``."""
    values = [0.5 if b % 2 == 0 else -0.25 for b in text.encode()]
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def agent() -> ModuleType:
    assert AGENT_PY.is_file(), (
        f"{AGENT_PY} is missing: `make test-ecosystem` fetches it from the openrlhf "
        "wheel (tests/ecosystem/fetch_openrlhf.py), or set OPENRLHF_AGENT_PY"
    )
    stub = SimpleNamespace(init_logger=logging.getLogger)
    saved = sys.modules.get("openrlhf.utils.logging_utils")
    sys.modules["openrlhf.utils.logging_utils"] = stub  # type: ignore[assignment]
    try:
        spec = importlib.util.spec_from_file_location("_openrlhf_agent", AGENT_PY)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("openrlhf.utils.logging_utils", None)
        else:
            sys.modules["openrlhf.utils.logging_utils"] = saved
    return module


class ByteTokenizer:
    """The two calls ``agent.py`` makes on an HF tokenizer, with UTF-8 bytes as token ids."""

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str = "pt") -> dict:
        return {"input_ids": torch.tensor([list(text.encode())])}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode()


class ScriptedEngine:
    """vLLM's ``generate`` as ``agent.py`` awaits it: the response for each prompt is scripted."""

    def __init__(self, responses: dict[str, str]) -> None:
        self.responses = responses

    async def generate(self, prompt_token_ids, params, multi_modal_data=None):
        text = self.responses[bytes(prompt_token_ids).decode()]
        ids = list(text.encode())[: params.max_tokens]
        return SimpleNamespace(
            outputs=[
                SimpleNamespace(
                    token_ids=ids,
                    text=bytes(ids).decode(),
                    logprobs=None,
                    finish_reason="length" if len(ids) < len(text) else "stop",
                )
            ]
        )


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str) -> PipelineConfig:
    cfg = isolated_config(
        f"openrlhf-{uuid.uuid4().hex[:8]}",
        kafka_bootstrap,
        redis_url,
        allowed_scorer_modules=[*TEST_SCORER_MODULES, "tests.ecosystem"],
        scorers=[
            PRMScorerConfig("tests.ecosystem.scorers.TokenParityScorer"),
            PRMScorerConfig("tests.scorers.FailOnMarkerScorer", kwargs={"marker": "FAIL"}),
        ],
    )
    return msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, verdict_timeout_s=60.0))


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("openrlhf-workers"), n=2) as procs:
        yield procs


PROMPTS = {  # prompt -> the engine's response
    "Q: 2+2? A:": " 4",  # 32, 52: both even
    "Q: name a letter. A:": " a",  # 32 even, 97 odd
    "Q: count. A:": " 1 2 3",
    "Q: please FAIL. A:": " ok",  # the FailOnMarker scorer raises: a rejected group
}


async def test_openrlhf_single_turn_executor_gets_process_rewards_from_two_gateways(agent, cfg, workers) -> None:
    engine, tokenizer = ScriptedEngine(PROMPTS), ByteTokenizer()
    async with gateway(cfg) as url_a, gateway(cfg) as url_b:
        executor = agent.SingleTurnAgentExecutor(f"{url_a}/openrlhf,{url_b}/openrlhf".split(","))
        params = SimpleNamespace(max_tokens=None, logprobs=None)
        prompts = [p for p in PROMPTS for _ in range(2)]  # every prompt twice, all at once
        outputs = await asyncio.gather(
            *(executor.execute(p, f"label-{i}", params, 64, tokenizer, engine) for i, p in enumerate(prompts))
        )
        hits = {}
        async with aiohttp.ClientSession() as http:
            for url in (url_a, url_b):
                async with http.get(f"{url}/metrics") as r:
                    text = await r.text()
                hits[url] = sum(
                    s.value
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                    if s.name == "prm_gateway_requests_total" and s.labels == {"route": "/openrlhf", "code": "200"}
                )

    for prompt, out in zip(prompts, outputs):
        response = PROMPTS[prompt]
        if "FAIL" in prompt:
            assert out["reward"] == [0.0] and out["scores"] == [0.0]
            assert out["extra_logs"]["prm_accepted"] == [0.0]
            continue
        expected = parity_mean(response)
        assert out["reward"] == [pytest.approx(expected)] and out["scores"] == out["reward"], (prompt, out)
        assert out["extra_logs"] == {
            "prm_outcome": [0.0],
            "prm_process": [pytest.approx(expected)],
            "prm_accepted": [1.0],
        }
        assert out["observation_tokens"] == list((prompt + response).encode()) and not out["truncated"]
    assert hits == {url_a: 4.0, url_b: 4.0}, hits  # OpenRLHF rotates its endpoints call by call


async def test_openrlhf_loads_our_reward_func_file(agent, cfg, workers, tmp_path, monkeypatch) -> None:
    """``--reward.remote_url .../openrlhf_reward.py``: OpenRLHF imports the file by path and
    calls ``reward_func`` in a thread; the config comes from ``$PRM_CONFIG``."""
    monkeypatch.setenv("PRM_CONFIG", str(write_config(cfg, tmp_path / "prm.yaml")))
    executor = agent.SingleTurnAgentExecutor(str(REWARD_FUNC_PY))
    assert executor.reward_func is not None and executor.reward_func.__module__ == "reward_func"
    try:
        params = SimpleNamespace(max_tokens=None, logprobs=None)
        outputs = await asyncio.gather(
            *(executor.execute(p, "", params, 64, ByteTokenizer(), ScriptedEngine(PROMPTS)) for p in PROMPTS)
        )
    finally:
        await asyncio.to_thread(executor.reward_func.__globals__["close"])
    for prompt, out in zip(PROMPTS, outputs):
        expected = 0.0 if "FAIL" in prompt else parity_mean(PROMPTS[prompt])
        assert out["reward"] == [pytest.approx(expected)], (prompt, out)
        assert out["extra_logs"]["prm_accepted"] == [0.0 if "FAIL" in prompt else 1.0]


async def test_a_truncated_prompt_is_refused_and_openrlhf_leaves_the_reward_none(agent, cfg, workers) -> None:
    """OpenRLHF cuts an over-long prompt from the left, so ``query`` no longer starts with
    ``prompts``: the gateway answers 400 naming the field, OpenRLHF retries 5 times and
    keeps ``reward=None`` (its documented behaviour for a failed reward call)."""
    prompt = "Q: a long question " + "x" * 40 + " A:"
    async with gateway(cfg) as url:
        executor = agent.SingleTurnAgentExecutor(f"{url}/openrlhf")
        params = SimpleNamespace(max_tokens=8, logprobs=None)
        out = await executor.execute(prompt, "", params, 32, ByteTokenizer(), ScriptedEngine({prompt[-24:]: " 4"}))
    assert out["reward"] is None and out["scores"] is None
    assert len(out["observation_tokens"]) == 24 + 2
