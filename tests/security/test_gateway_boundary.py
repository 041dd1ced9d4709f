"""The reward gateway's request boundary, over real HTTP: what an attacker's bytes can and cannot do.

Each test is one finding of the gateway attack test (issue 33) and failed before bodies
were decoded by declared structs (``prm_pipeline/gateway_api.py``):

* a bearer token in an oversized ``Authorization`` header landed in the log (and in
  aiohttp's plain-text answer);
* deeply nested JSON was a 500 with a RecursionError traceback;
* unknown top-level fields on ``/v1/score`` were accepted;
* ``response_mask`` values other than 0/1 were accepted.

And what stays: the framework routes tolerate fields their clients may add, 404 and
405 answer JSON, and the OpenAPI document is served behind the tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from infra.config import PRMScorerConfig
from prm_pipeline.gateway_api import openapi_document
from tests.integration.harness import isolated_config, running_worker
from tests.integration.test_gateway import gateway, post

pytestmark = pytest.mark.integration

BUDGET = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 1000})
TOKEN = "gw-token-5d1c9e04b7"
SAMPLE = {"prompt_ids": [1, 2, 3], "response_ids": [10, 11]}


@pytest.fixture
def cfg(kafka_bootstrap: str, redis_url: str, unique_name: str):
    return isolated_config(unique_name, kafka_bootstrap, redis_url, scorers=[BUDGET])


async def raw_request(url: str, head: bytes, body: bytes = b"{}") -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` (request line and headers, unchecked) and ``body`` on a fresh connection; the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)  # the gateway closes after refusing
    finally:
        writer.close()
    header_block, _, payload = data.partition(b"\r\n\r\n")
    status_line, *lines = header_block.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split(" ")[1]), headers, payload


# --------------------------------------------------------------------------- finding 5
async def test_an_oversized_or_malformed_header_is_a_clean_4xx_and_its_bytes_reach_no_log(
    cfg, tmp_path, caplog
) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN)
    for name in ("aiohttp", "prm_pipeline"):
        caplog.set_level(logging.DEBUG, logger=name)
    start = b"POST /v1/score HTTP/1.1\r\nHost: gw\r\n"
    cases = [  # (header lines, expected status)
        (f"Authorization: Bearer {TOKEN}{'A' * 9000}\r\n".encode(), 431),  # the finding: a padded token
        (f"X-{TOKEN}{'B' * 9000}: 1\r\n".encode(), 431),  # an oversized header name
        ("".join(f"X-H{i}: Bearer {TOKEN}\r\n" for i in range(200)).encode(), 431),  # too many headers
        (f"Authorization: Bearer {TOKEN}\x00x\r\n".encode(), 400),  # a control character in a value
        (f"X-{TOKEN}\x01: 1\r\n".encode(), 400),  # a control character in a name
    ]
    async with gateway(cfg, auth_tokens_file=str(token_file)) as url:
        for lines, expected in cases:
            status, headers, body = await raw_request(url, start + lines)
            assert status == expected, (lines[:40], status, body[:200])
            assert headers["content-type"].startswith("application/json"), headers
            assert TOKEN.encode() not in body and b"AAAA" not in body, body[:300]
            assert set(json.loads(body)) == {"error"}
        # the gateway still answers, and the token still works
        status, answer, _ = await post(
            f"{url}/v1/score", {"samples": "x"}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert status == 400 and "$.samples" in answer["error"], answer
    assert "refused a malformed HTTP request" in caplog.text
    assert TOKEN not in caplog.text and "Got more than" not in caplog.text, caplog.text[-2000:]


# --------------------------------------------------------------------------- finding 6
async def test_deeply_nested_json_is_a_400_not_a_recursion_error(cfg, caplog) -> None:
    caplog.set_level(logging.INFO)
    deep = "[" * 100_000 + "]" * 100_000
    cases = [  # (route, body, what the error names)
        ("/v1/score", f'{{"samples": {deep}}}', "body nests JSON deeper than 64 levels"),  # the finding
        (
            "/v1/score",
            json.dumps({"samples": [{**SAMPLE, "messages": [{"role": "user", "x": "@"}]}]}).replace('"@"', deep),
            "body nests JSON deeper than 64 levels",
        ),  # free-form JSON inside a declared field
        (
            "/slime",
            f'{{"prompt": "p", "response": "r", "extra": {deep}}}',
            "body nests JSON deeper than 64 levels",
        ),  # a field the route ignores
        (
            "/openrlhf",
            f'{{"query": ["ab"], "prompts": ["a"], "labels": [{"[" * 40}{"]" * 40}]}}',
            "`labels` nests deeper than 32 levels",
        ),
        (
            "/v1/score",
            json.dumps({"samples": [{**SAMPLE, "messages": [{"x": "@"}]}]}).replace(
                '"@"', '{"a": ' * 40 + "1" + "}" * 40
            ),
            "`messages` nests deeper than 32 levels",
        ),
    ]
    async with gateway(cfg, verdict_timeout_s=2.0) as url:
        for route, body, named in cases:
            status, answer, _ = await post(
                f"{url}{route}", data=body.encode(), headers={"Content-Type": "application/json"}
            )
            assert status == 400 and named in answer["error"], (route, status, answer)
    assert "RecursionError" not in caplog.text and "Traceback" not in caplog.text


# --------------------------------------------------------------------------- finding 7
async def test_unknown_top_level_fields_on_v1_score_are_refused(cfg) -> None:
    async with gateway(cfg, verdict_timeout_s=2.0) as url:
        for field in ("scorers", "topic", "experiment_id", "__class__"):
            status, answer, _ = await post(f"{url}/v1/score", {"samples": [SAMPLE], field: "evil"})
            assert status == 400, (field, status, answer)
            assert answer["error"] == f"Object contains unknown field `{field}` - at `$`", answer


# --------------------------------------------------------------------------- finding 8
async def test_response_mask_takes_only_zeros_and_ones(cfg) -> None:
    async with gateway(cfg, verdict_timeout_s=2.0) as url:
        for mask, where in (([1, 2], 1), ([-1, 1], 0), ([0.5, 1], 0), ([True, 1], 0)):
            status, answer, _ = await post(f"{url}/v1/score", {"samples": [{**SAMPLE, "response_mask": mask}]})
            assert status == 400, (mask, status, answer)
            assert answer["error"].endswith(f"- at `$.samples[0].response_mask[{where}]`"), (mask, answer)
        status, answer, _ = await post(f"{url}/v1/score", {"samples": [{**SAMPLE, "response_mask": [1]}]})
        assert status == 400 and "`response_mask` has 1 values for 2 response tokens" in answer["error"], answer
        assert answer["error"].endswith("- at `$.samples[0]`")


# --------------------------------------------------------------------------- what stays
async def test_framework_routes_ignore_fields_their_clients_may_add(cfg) -> None:
    """OpenRLHF and slime own their payloads: a field a later release adds must not become a 400
    (OpenRLHF would retry, then train without a reward). The field is never read."""
    async with running_worker(cfg, "w-gw-compat"), gateway(cfg) as url:
        status, body, _ = await post(
            f"{url}/openrlhf",
            {
                "query": ["Q: A: 4"],
                "prompts": ["Q: A:"],
                "labels": [None],
                "scorers": ["evil.Module"],
                "datasource": "gsm8k",
            },
        )
        assert status == 200 and body["status"] == ["accepted"], body
        status, body, _ = await post(
            f"{url}/slime",
            {
                "prompt": [{"role": "user", "content": "hi", "tool_calls": []}],
                "response": "ok",
                "label": {"answer": 4},
                "metadata": {"k": 1},
            },
        )
        assert status == 200 and body["status"] == "accepted", body


async def test_404_and_405_answer_json_and_openapi_is_behind_the_tokens(cfg, tmp_path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with gateway(cfg, auth_tokens_file=str(token_file)) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/nowhere/{TOKEN}", headers=auth) as r:
            assert r.status == 404 and r.content_type == "application/json"
            assert TOKEN not in (await r.text()) and "no such route" in (await r.json())["error"]
        async with http.get(f"{url}/v1/score", headers=auth) as r:
            assert r.status == 405 and r.content_type == "application/json" and r.headers["Allow"] == "POST"
            assert "takes POST" in (await r.json())["error"]
        for probe in ("/healthz", "/readyz"):  # the probes (open without a token) answer their 405 as JSON too
            async with http.post(f"{url}{probe}") as r:
                assert r.status == 405 and r.content_type == "application/json", (probe, await r.text())
                assert "GET" in r.headers["Allow"] and "takes GET" in (await r.json())["error"], probe
        async with http.get(f"{url}/nowhere") as r:
            assert r.status == 401  # without a token, not even whether a route exists
        async with http.get(f"{url}/openapi.json") as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        async with http.get(f"{url}/openapi.json", headers=auth) as r:
            assert r.status == 200 and await r.json() == openapi_document()
