"""Untrusted text is shown escaped: a worker's log, ``experiment list``, ``dead-letters`` and its
redrive plan, against the embedded broker and Redis with real CLI processes.

A newline in a group id, in a payload's ``kind`` or in a registry key would otherwise forge a
whole log or terminal line (``2030-01-01 00:00:00,000 ERROR ...``), and an ANSI escape would
reach the log and the operator's terminal raw (infra/escape.py, infra/logs.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest
from aiokafka.structs import ConsumerRecord

from infra.config import PRMScorerConfig
from infra.kafka import ensure_topics, make_producer
from infra.schema import InvalidMessage, dead_letter_headers, encode
from prm_pipeline.demo.synthetic import make_group
from scoring_workers.dead_letters import capped_letter
from tests.integration.harness import read_topic, with_scorers, worker_processes, write_config
from tests.polling import poll_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

FORGED = "2030-01-01 00:00:00,000 ERROR forged"
LENGTH = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 64})


def _hostile(tag: str) -> str:
    """Text that forges a line, colours the terminal, breaks lines for log viewers and reverses
    what follows it, with ``tag`` to find it by."""
    return f"{tag}\x1b[31m\x9b2J\u2028\u202e\r\n{FORGED}"  # under 80 characters: registry keys are cut there


def _escaped(tag: str) -> str:
    return f"{tag}\\x1b[31m\\x9b2J\\u2028\\u202e\\r\\n{FORGED}"


def _assert_clean(text: str) -> None:
    """No forged line, no raw escape, separator or bidi character anywhere in ``text``."""
    lines = text.split("\n")
    assert not [line for line in lines if line.startswith(FORGED)], text[-3000:]
    assert not any(c in text for c in "\x1b\x9b\r\u2028\u202e"), text[-3000:]


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


async def _send(cfg, topic: str, value: bytes, key: bytes | None, headers: list[tuple[str, bytes]] = ()) -> None:
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key, headers=list(headers))
    finally:
        await producer.stop()


async def _log_holds(path: Path, needles: list[str], timeout_s: float) -> str:
    """The log at ``path`` once it holds every needle, or as it is at the deadline."""
    polled = await poll_until(
        lambda: path.read_text(errors="replace") if path.exists() else "",
        accept=lambda text: all(n in text for n in needles),
        timeout_s=timeout_s,
        interval_s=0.2,
    )
    return polled.last


async def test_a_worker_logs_a_hostile_group_id_payload_kind_and_registry_key_as_one_escaped_line(
    pipeline_config, tmp_path
) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    tag = uuid.uuid4().hex[:8]
    group_tag, kind_tag, key_tag = f"g-{tag}", f"kind-{tag}", f"exp-{tag}"
    (member,) = make_group(_hostile(group_tag), 1, turns=1, output_tokens=3)
    value, headers = encode(member)
    forged_kind = msgspec.msgpack.decode(value)
    forged_kind["kind"] = _hostile(kind_tag)
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.experiments])
    async with worker_processes(cfg, tmp_path, n=1):
        await _send(cfg, cfg.topics.experiments, b"{}", _hostile(key_tag).encode())
        await _send(cfg, cfg.topics.trajectories, value, member.group_id.encode(), headers)
        await _send(cfg, cfg.topics.trajectories, msgspec.msgpack.encode(forged_kind), None, headers)
        log = await _log_holds(tmp_path / "worker0.1.log", ["matching regex", kind_tag, key_tag], timeout_s=60)
    # the hostile group id breaks the id grammar: its record is dead-lettered naming the grammar, not the id
    assert "matching regex" in log and kind_tag in log and key_tag in log, log[-3000:]
    assert group_tag not in log.replace(_escaped(group_tag), ""), log[-3000:]  # never raw
    _assert_clean(log)
    for needle in (kind_tag, key_tag):  # each quoted on lines of their own record, escaped
        assert any(_escaped(needle) in line for line in log.splitlines()), log[-3000:]


async def test_experiment_list_shows_a_hostile_registry_key_escaped(pipeline_config, tmp_path) -> None:
    config = write_config(pipeline_config, tmp_path / "config.yaml")
    await ensure_topics(pipeline_config.kafka, pipeline_config.topics, [pipeline_config.topics.experiments])
    tag = f"exp-{uuid.uuid4().hex[:8]}"
    await _send(pipeline_config, pipeline_config.topics.experiments, b"{}", _hostile(tag).encode())
    listed = await asyncio.to_thread(_cli, config, "experiment", "list")
    assert listed.returncode == 0, listed.stderr
    _assert_clean(listed.stdout)
    (line,) = [line for line in listed.stdout.splitlines() if tag in line]
    assert line.startswith(_escaped(tag)) and "REFUSED" in line, line


async def _hostile_dead_letter(cfg, tmp_path: Path) -> tuple[Path, str]:
    """A dead letter whose record names a hostile group and whose error quotes hostile text
    (as a worker writes it: ``capped_letter``); the config file and the error's tag."""
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    tag = uuid.uuid4().hex[:8]
    (member,) = make_group(_hostile(f"g-{tag}"), 1, turns=1, output_tokens=3)
    value, headers = encode(member)
    record = ConsumerRecord(
        topic=cfg.topics.trajectories,
        partition=0,
        offset=3,
        timestamp=0,
        timestamp_type=0,
        key=member.group_id.encode(),
        value=value,
        checksum=None,
        serialized_key_size=-1,
        serialized_value_size=len(value),
        headers=headers,
    )
    letter, key = capped_letter(
        record,
        InvalidMessage(f"refused {_hostile(f'err-{tag}')}"),
        1,
        worker_id="w-old",
        max_message_bytes=cfg.kafka.max_message_bytes,
        dead_letter_max_bytes=cfg.worker.dead_letter_max_bytes,
    )
    await _send(cfg, cfg.topics.dead_letters, letter.payload, key, dead_letter_headers(letter))
    assert len(await read_topic(cfg, cfg.topics.dead_letters)) == 1
    return config, f"err-{tag}"


async def test_dead_letters_lists_hostile_text_escaped_and_exact(pipeline_config, tmp_path) -> None:
    config, error_tag = await _hostile_dead_letter(pipeline_config, tmp_path)
    listed = await asyncio.to_thread(_cli, config, "dead-letters")
    assert listed.returncode == 0, listed.stderr
    _assert_clean(listed.stdout)
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["error_message"] == f"refused {_hostile(error_tag)}"  # the JSON keeps the text exactly


async def test_the_redrive_plan_shows_hostile_text_escaped(pipeline_config, tmp_path) -> None:
    config, error_tag = await _hostile_dead_letter(pipeline_config, tmp_path)
    plan = await asyncio.to_thread(_cli, config, "dead-letters", "--redrive")
    assert plan.returncode == 0, plan.stderr
    _assert_clean(plan.stdout)
    (line,) = [line for line in plan.stdout.splitlines() if error_tag in line]
    assert _escaped(error_tag) in line and "dry run" in plan.stdout.splitlines()[-1], plan.stdout
