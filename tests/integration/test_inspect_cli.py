"""``verdicts --tokens --out FILE`` then ``inspect --verdicts FILE``: the README's example file
end to end, with raw ids by default, ``--tokenizer`` on request, and a line for the
discarded group."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka import ensure_topics
from prm_pipeline.demo.processes import write_config
from scoring_workers.worker import Worker
from tests.integration.harness import demo_config_on

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _cli(config: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _small_tokenizer(path: Path, size: int = 50) -> Path:
    """A word-level tokenizer.json with ``size`` ids: the example's ids (101..) are outside it."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(size)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path))
    return path


async def test_inspect_reads_what_verdicts_writes_with_tokens(pipeline_config, tmp_path) -> None:
    cfg = demo_config_on(pipeline_config)
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    published = await asyncio.to_thread(_cli, config, "publish", str(REPO / "examples" / "trajectories.jsonl"))
    assert published.returncode == 0, published.stderr

    out = tmp_path / "verdicts.jsonl"
    stop = asyncio.Event()
    worker = asyncio.create_task(Worker(cfg, worker_id="w-inspect-cli").run(stop))
    try:
        dumped = await asyncio.to_thread(
            _cli,
            config,
            "verdicts",
            "--from-beginning",
            "--max",
            "2",
            "--idle-timeout",
            "60",
            "--tokens",
            "--out",
            str(out),
            timeout=120,
        )
    finally:
        stop.set()
        await worker
    assert dumped.returncode == 0, dumped.stderr

    shown = await asyncio.to_thread(_cli, str(config), "inspect", "--verdicts", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "carries no" not in shown.stderr
    # raw ids by default, and a note saying how to decode them
    assert "[201][202]" in shown.stdout and "[s1-i2]" in shown.stdout
    assert "token ids shown raw" in shown.stderr and "--tokenizer" in shown.stderr
    # the discarded group gets a line, with its reason
    assert "group example-dropped: discarded (environment crashed before the second session finished)" in shown.stdout

    # a tokenizer that does not cover the ids: text where it can, a warning, and [id?] for the rest
    tok = _small_tokenizer(tmp_path / "tokenizer.json")
    decoded = await asyncio.to_thread(_cli, str(config), "inspect", "--verdicts", str(out), "--tokenizer", str(tok))
    assert decoded.returncode == 0, decoded.stderr
    assert "outside" in decoded.stderr and "vocabulary (50 ids)" in decoded.stderr
    assert "[201?]" in decoded.stdout and "token ids shown raw" not in decoded.stderr

    missing = await asyncio.to_thread(
        _cli, str(config), "inspect", "--verdicts", str(out), "--tokenizer", str(tmp_path / "nope.json")
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr

    # without --tokens the file says what to do instead of "carries no interactions"
    plain = tmp_path / "plain.jsonl"
    again = await asyncio.to_thread(
        _cli, config, "verdicts", "--from-beginning", "--max", "2", "--idle-timeout", "30", "--out", str(plain)
    )
    assert again.returncode == 0, again.stderr
    refused = await asyncio.to_thread(_cli, str(config), "inspect", "--verdicts", str(plain), "--group", "example-math")
    assert refused.returncode == 1 and "verdicts --tokens" in refused.stderr
