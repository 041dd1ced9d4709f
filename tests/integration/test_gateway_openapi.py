"""Schemathesis fuzzes the running gateway against its own OpenAPI document.

A real gateway (embedded broker, a real worker, so valid requests get their 200) serves
``/openapi.json``; ``schemathesis run`` (its CLI, in a subprocess: the gateway lives on
this test's event loop, which the CLI must not block) fetches it and sends generated
requests, valid and invalid, to every operation. The run passes only if:

* no answer is a 5xx (``not_a_server_error``);
* every status, content type, declared header and body is what the document says
  (``status_code_conformance``, ``content_type_conformance``,
  ``response_headers_conformance``, ``response_schema_conformance``);
* every body the document calls invalid is refused with a 4xx (``negative_data_rejection``);
* a method a route does not take is a 405 with ``Allow`` (``unsupported_method``).

``positive_data_acceptance`` is left out: a body can fit the schema and still be refused,
by rules JSON Schema cannot state (one mask value per response token, ``query[i]`` starting
with ``prompts[i]``). Bounded to about a minute: a few examples per operation, generated
deterministically, one worker thread (CPython 3.11's ``ast.parse``, which Hypothesis calls to
describe strategies, can fail with "AST constructor recursion depth mismatch" when threads
race it).
"""

from __future__ import annotations

import asyncio
import sys
import xml.etree.ElementTree as ET

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infra.config import PRMScorerConfig
from tests.integration.harness import isolated_config, running_worker
from tests.integration.test_gateway import gateway

pytestmark = pytest.mark.integration

BUDGET = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 1_000_000})
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "unsupported_method",
)


async def test_schemathesis_finds_no_5xx_and_no_answer_outside_the_document(
    kafka_bootstrap, redis_url, unique_name, tmp_path
) -> None:
    cfg = isolated_config(unique_name, kafka_bootstrap, redis_url, scorers=[BUDGET])
    async with running_worker(cfg, "w-gw-fuzz"), gateway(cfg, verdict_timeout_s=20.0) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            f"{url}/openapi.json",
            "--checks",
            ",".join(CHECKS),
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            "30",
            "--generation-deterministic",
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--suppress-health-check",
            "all",
            "--no-color",
            "--report",
            "junit",
            "--report-dir",
            str(tmp_path),
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(proc.communicate(), 240)
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
            metrics = await r.text()
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    (report,) = tmp_path.glob("junit-*.xml")
    tested = {case.get("name") for case in ET.parse(report).iter("testcase")}
    assert {"POST /openrlhf", "POST /slime", "POST /v1/score"} <= tested, tested
    answered = {
        (s.labels["route"], s.labels["code"])
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "prm_gateway_requests_total" and s.value > 0
    }
    for route in ("/openrlhf", "/slime", "/v1/score"):  # valid bodies were scored, invalid ones refused
        assert {(route, "200"), (route, "400")} <= answered, (route, sorted(answered))
    assert not any(code.startswith("5") for _, code in answered), sorted(answered)
