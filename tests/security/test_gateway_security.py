"""The reward gateway's security rules, over real HTTP and HTTPS against the embedded stack.

Loopback by default; beyond it only with bearer tokens or an explicit flag; tokens
from a file or an environment variable, several at once for rotation, and a refusal
that never says which part was wrong; TLS with a given certificate; a slow body
times out instead of holding a slot; no token or request text in logs or metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import subprocess
import sys

import aiohttp
import msgspec
import pytest

from infra.config import ConfigError, PRMScorerConfig
from prm_pipeline.gateway import check_exposure
from tests.integration.harness import isolated_config, running_worker
from tests.integration.test_gateway import gateway, post

pytestmark = pytest.mark.integration

BUDGET = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 1000})
OLD, NEW = "old-token-3f9a2c77e1", "new-token-b81d04e6aa"


@pytest.fixture
def cfg(kafka_bootstrap: str, redis_url: str, unique_name: str):
    return isolated_config(unique_name, kafka_bootstrap, redis_url, scorers=[BUDGET])


def test_loopback_by_default_and_all_interfaces_need_auth_or_the_flag(cfg, caplog) -> None:
    assert cfg.gateway.host == "127.0.0.1"
    public = msgspec.structs.replace(cfg.gateway, host="0.0.0.0")
    with pytest.raises(ConfigError, match="without authentication"):
        check_exposure(public, authenticated=False, allow_unauthenticated=False)
    check_exposure(public, authenticated=True, allow_unauthenticated=False)
    with caplog.at_level(logging.WARNING):
        check_exposure(public, authenticated=False, allow_unauthenticated=True)
    assert "WITHOUT authentication" in caplog.text

    env = {k: v for k, v in os.environ.items() if not k.startswith("PRM_")}
    env.update(PRM_GATEWAY_HOST="0.0.0.0", PRM_KAFKA_BOOTSTRAP=cfg.kafka.bootstrap)
    proc = subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "gateway", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--allow-unauthenticated" in proc.stderr


async def test_bearer_tokens_from_file_and_env_rotate_and_refusals_say_nothing(cfg, tmp_path, monkeypatch) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{OLD}\n")
    monkeypatch.setenv("GATEWAY_TOKENS_TEST", NEW)
    async with (
        running_worker(cfg, "w-gw-auth"),
        gateway(cfg, auth_tokens_file=str(token_file), auth_tokens_env="GATEWAY_TOKENS_TEST") as url,
    ):
        body = {"prompt": "p", "response": "ok"}
        refusals = []
        for headers in (
            {},
            {"Authorization": f"Bearer {OLD}x"},
            {"Authorization": f"Basic {OLD}"},
            {"Authorization": f"Bearer {OLD[:-1]}"},
        ):
            status, answer, _ = await post(f"{url}/slime", body, headers=headers)
            refusals.append((status, answer))
        assert refusals == [(401, {"error": "unauthorized"})] * 4  # the same answer whatever was wrong
        for token in (OLD, NEW):  # both, during a rotation
            status, answer, _ = await post(f"{url}/slime", body, headers={"Authorization": f"Bearer {token}"})
            assert status == 200 and answer["status"] == "accepted", answer
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
            assert r.status == 401  # metrics are behind the same tokens
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as r:
            assert r.status == 200  # probes are not


async def test_https_with_a_given_certificate(cfg, pki) -> None:
    async with (
        running_worker(cfg, "w-gw-tls"),
        gateway(cfg, tls_certfile=str(pki.cert), tls_keyfile=str(pki.key)) as url,
    ):
        https = url.replace("http://", "https://")
        trust = ssl.create_default_context(cafile=str(pki.ca))
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{https}/slime", json={"prompt": "p", "response": "ok"}, ssl=trust) as r:
                assert r.status == 200 and (await r.json())["status"] == "accepted"
            with pytest.raises(aiohttp.ClientError):  # plain HTTP is not served
                async with http.post(f"{url}/slime", json={"prompt": "p", "response": "ok"}) as r:
                    await r.read()


async def test_a_slow_body_times_out_and_frees_its_slot(cfg) -> None:
    async with gateway(cfg, read_timeout_s=1.0, max_in_flight_per_client=1) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b'POST /slime HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt"'
        )  # and then nothing
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert b" 408 " in status_line
        # the slot is free again: a well-formed (bad) request gets its own answer, not 429
        status, answer, _ = await post(f"{url}/slime", {"prompt": 1})
        assert status == 400, answer


async def test_no_token_or_request_text_in_logs_or_metrics(cfg, tmp_path, caplog) -> None:
    secret_text = "PATIENT-RECORD-7731"
    token_file = tmp_path / "tokens"
    token_file.write_text(OLD)
    caplog.set_level(logging.INFO)  # what `prm-pipeline gateway` logs (aiokafka's DEBUG dumps wire requests)
    async with running_worker(cfg, "w-gw-logs"), gateway(cfg, auth_tokens_file=str(token_file)) as url:
        auth = {"Authorization": f"Bearer {OLD}"}
        await post(f"{url}/slime", {"prompt": secret_text, "response": secret_text}, headers=auth)
        await post(f"{url}/slime", {"prompt": secret_text}, headers=auth)  # a 400
        await post(f"{url}/slime", {"prompt": secret_text, "response": "x"}, headers={"Authorization": "Bearer nope"})
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics", headers=auth) as r:
            metrics = await r.text()
    assert "prm_gateway_requests_total" in metrics
    for secret in (OLD, "nope", secret_text):
        assert secret not in caplog.text and secret not in metrics
