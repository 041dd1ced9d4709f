"""``prm-pipeline inspect --group ID`` reads the verdict from the real verdicts topic."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from infra.config import PipelineConfig
from infra.kafka import ensure_topics
from prm_pipeline.demo.processes import write_config
from prm_pipeline.token_view import cmd_inspect
from tests import real_model
from tests.integration.test_verdict_consumer import publish
from tests.real_model import one_torch_thread  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.integration


def test_inspect_group_from_the_topic_renders_a_branching_session(
    pipeline_config: PipelineConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = real_model.proxy(seed=7)
    gid = "g-inspect"  # the topics are this test's own
    sessions = [
        proxy.session(gid, 0, "compute 5 + 5", turns=2, branch=True),
        proxy.session(gid, 1, "compute 5 + 5", turns=1, branch=False),
    ]

    async def setup() -> None:
        await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
        await publish(pipeline_config, [await real_model.verdict(gid, sessions)])

    asyncio.run(setup())
    out = tmp_path / "view.html"
    args = argparse.Namespace(
        config=str(write_config(pipeline_config, tmp_path / "config.yaml")),
        group=gid,
        verdicts=None,
        audit=None,
        session=None,
        max_groups=3,
        html=str(out),
        no_terminal=False,
        wait=30.0,
    )
    assert cmd_inspect(args) == 0
    terminal = capsys.readouterr().out
    assert "[g-inspect-s0-t1b]" in terminal and "[g-inspect-s0-t1]" in terminal and "[g-inspect-s1-t0]" in terminal
    page = out.read_text()
    assert page.count('class="branch"') == 3  # two branches of s0, one of s1
    assert "branching session" in page

    args.group = "no-such-group"
    args.wait = 2.0
    assert cmd_inspect(args) == 1
