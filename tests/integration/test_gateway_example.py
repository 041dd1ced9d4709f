"""``examples/gateway.yaml`` works as shipped: a CLI worker and a CLI gateway on that file
answer OpenRLHF's and slime's text requests (docs/integrations/gateway.md, "First reward").

Only the addresses and names a test must own are replaced (Kafka, Redis, topics, the
workers' consumer group); the scorer, the tokenizer and every gateway setting are the
file's.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from infra.config import PipelineConfig, load_config
from prm_pipeline.demo.processes import write_config
from tests.integration.harness import worker_processes
from tests.integration.test_gateway import post

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gateway.yaml"


@contextlib.asynccontextmanager
async def cli_gateway(config: Path, log: Path) -> AsyncIterator[str]:
    """``prm-pipeline --config FILE gateway --port 0`` as a user starts it; yields its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "prm_pipeline.cli",
        "--config",
        str(config),
        "gateway",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=log.open("wb"),
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        match = re.fullmatch(r"listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, f"unexpected first line {line!r}; log:\n{log.read_text()}"
        yield match.group(1)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 60)
    assert code == 0, f"gateway exited with {code}:\n{log.read_text()}"


def example_config(test_cfg: PipelineConfig) -> PipelineConfig:
    example = load_config(EXAMPLE, environ={})
    return msgspec.structs.replace(
        example,
        kafka=test_cfg.kafka,
        redis=test_cfg.redis,
        topics=test_cfg.topics,
        worker=msgspec.structs.replace(example.worker, group_id=test_cfg.worker.group_id),
    )


async def test_example_gateway_config_answers_openrlhf_and_slime(pipeline_config, tmp_path) -> None:
    cfg = example_config(pipeline_config)
    shipped = load_config(EXAMPLE, environ={})
    assert (cfg.gateway, cfg.rollout, cfg.worker.allowed_scorer_modules) == (
        shipped.gateway,
        shipped.rollout,
        shipped.worker.allowed_scorer_modules,
    )
    assert cfg.gateway.tokenizer == "bytes" and cfg.gateway.host == "127.0.0.1"
    config = write_config(cfg, tmp_path / "gateway.yaml")

    async with worker_processes(cfg, tmp_path, n=1), cli_gateway(config, tmp_path / "gateway.log") as url:
        # OpenRLHF: query = prompt + response. The example's scorer pays 1.0 per token of a
        # turn of at most 64 tokens (bytes here): a short answer 1.0, a 65-byte one 0.0.
        long_answer = " " + "x" * 64
        status, body, _ = await post(
            f"{url}/openrlhf",
            {
                "query": ["Q: 2+2? A: 4", "Q: describe x A:" + long_answer],
                "prompts": ["Q: 2+2? A:", "Q: describe x A:"],
                "labels": ["4", ""],
            },
        )
        assert status == 200, body
        assert body["rewards"] == [1.0, 0.0] and body["scores"] == [1.0, 0.0]
        assert body["status"] == ["accepted", "accepted"]
        assert body["extra_logs"] == {"prm_outcome": [0.0, 0.0], "prm_process": [1.0, 0.0], "prm_accepted": [1.0, 1.0]}

        # slime: {prompt, response, label}; the response is 2 tokens (bytes) long
        status, body, _ = await post(f"{url}/slime", {"prompt": "Q: hi", "response": " 4", "label": "4"})
        assert status == 200, body
        assert body["score"] == 1.0 and body["status"] == "accepted"
        assert body["token_rewards"] == [1.0, 1.0] and body["turn_rewards"] == [1.0]
