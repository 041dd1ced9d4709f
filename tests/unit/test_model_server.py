"""``prm-pipeline model-server``: SGLang and OpenAI shapes from the tiny LM, weight following."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from prm_pipeline.demo.model_server import ModelServer
from prm_pipeline.demo.tiny_model import TinyPolicy, WeightStore
from tests import real_model
from tests.real_model import one_torch_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def server():
    with ModelServer(real_model.policy()) as srv:
        yield srv


def test_teacher_forward_answers_sglang_input_token_logprobs(server: ModelServer) -> None:
    policy = real_model.policy()
    ids = policy.template.render([{"role": "user", "content": "compute 1 + 1"}]) + [70, 71, 72]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": len(ids) - 4,
    }
    answer = httpx.post(f"{server.base_url}/generate", json=body, timeout=30).json()
    rows = answer["meta_info"]["input_token_logprobs"]
    assert [r[1] for r in rows] == ids[-4:]  # one row per position from logprob_start_len on, with its id
    direct = policy.prompt_logprobs(ids)[-4:]
    assert [r[0] for r in rows] == pytest.approx(direct, abs=1e-6)
    first = httpx.post(f"{server.base_url}/generate", json={**body, "logprob_start_len": 0}, timeout=30).json()
    assert first["meta_info"]["input_token_logprobs"][0][0] is None  # no context for position 0, as SGLang


def test_sampling_chat_and_tokenize(server: ModelServer) -> None:
    messages = [{"role": "user", "content": "compute 2 + 2"}]
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 5},
        timeout=30,
    ).json()
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] <= 5
    gen = httpx.post(
        f"{server.base_url}/generate",
        json={"text": "compute", "sampling_params": {"max_new_tokens": 4}, "return_logprob": True},
        timeout=30,
    ).json()
    assert 1 <= len(gen["output_ids"]) <= 4 and len(gen["meta_info"]["output_token_logprobs"]) == len(gen["output_ids"])
    tok = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": messages, "add_generation_prompt": True}, timeout=30
    ).json()
    assert tok["tokens"] == real_model.policy().template.render(messages)


def test_bad_requests_get_400(server: ModelServer) -> None:
    for body in (
        {"input_ids": [1, 2, 10**6], "sampling_params": {"max_new_tokens": 0}},
        {"sampling_params": {"max_new_tokens": 0}},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}, "logprob_start_len": 5},
    ):
        assert httpx.post(f"{server.base_url}/generate", json=body, timeout=30).status_code == 400
    assert httpx.post(f"{server.base_url}/nope", json={}, timeout=30).status_code == 404


def test_follows_the_newest_published_weights(tmp_path: Path) -> None:
    store = WeightStore(tmp_path)
    trained = TinyPolicy.create()
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(0.01)
    with ModelServer(TinyPolicy.create(), weights=str(tmp_path)) as srv:
        ids = {"input_ids": [1, 70, 71, 72], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        before = httpx.post(f"{srv.base_url}/generate", json=ids, timeout=30).json()["meta_info"]
        store.publish(trained.model, 1)
        after = httpx.post(f"{srv.base_url}/generate", json=ids, timeout=30).json()["meta_info"]
        health = httpx.get(f"{srv.base_url}/health", timeout=30).json()
    assert before["policy_version"] == 0 and after["policy_version"] == 1 and health["policy_version"] == 1
    assert [r[0] for r in after["input_token_logprobs"][1:]] == pytest.approx(
        trained.prompt_logprobs([1, 70, 71, 72])[1:], abs=1e-6
    )
    assert after["input_token_logprobs"] != before["input_token_logprobs"]
