"""The CLI answers a newcomer's usual moves in one line, against a real broker and Redis:
``verdicts`` on a terminal says it is waiting; ``inspect --group`` of an open group says it
is open; ``dead-letters --redrive`` refuses ``--out`` and names an ``--offsets`` entry that
matches nothing; ``publish`` of a line of another experiment names FILE:LINE; two workers
with one ``--worker-id`` are warned. Commands run in-process (:func:`prm_pipeline.cli.main`)."""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import uuid

import msgspec
import pytest

from infra import jsonl
from infra.kafka import ensure_topics
from prm_pipeline.cli import main
from prm_pipeline.demo.processes import write_config
from prm_pipeline.demo.synthetic import make_group
from prm_pipeline.verdict_dump import dump_verdicts
from producers.publisher import TrajectoryPublisher
from scoring_workers import heartbeat
from scoring_workers.heartbeat import Heartbeat
from scoring_workers.ledger import LedgerView
from tests.integration.harness import running_worker, with_scorers
from tests.integration.test_fleet import LENGTH
from tests.polling import eventually

pytestmark = pytest.mark.integration


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_verdicts_on_a_terminal_says_once_that_it_waits(pipeline_config, monkeypatch) -> None:
    await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    for terminal in (True, False):
        stderr = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr(sys, "stderr", stderr)
        code = await asyncio.to_thread(
            dump_verdicts, pipeline_config, from_beginning=False, max_count=None, timeout_s=1.0, out=None
        )
        monkeypatch.undo()
        lines = stderr.getvalue().splitlines()
        waiting = f"waiting for verdicts on {pipeline_config.topics.verdicts} (Ctrl-C to stop)"
        assert code == 0 and lines == ([waiting] if terminal else []) + ["0 verdicts"], lines


async def test_inspect_of_an_open_group_says_it_is_open(pipeline_config, tmp_path, capsys) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    config = str(write_config(cfg, tmp_path / "config.yaml"))
    gid = f"open-{uuid.uuid4().hex[:6]}"
    view = LedgerView.from_config(cfg.redis)
    try:
        async with running_worker(cfg, "w-open"):
            async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                await pub.publish_many(make_group(gid, 2)[:1])  # one of two members: the group stays open
            await eventually(
                lambda: view.group_state(gid),
                accept=lambda state: state is not None and state.parked >= 1,
                timeout_s=30,
                what="the member parked",
            )
            code, _, err = await _cli(capsys, "--config", config, "inspect", "--group", gid, "--wait", "0.5")
    finally:
        await view.aclose()
    assert code == 1
    assert err.startswith(
        f"inspect: no verdict for group {gid!r}; it is open: 1 of 2 members parked, decided when the rest arrive or in "
    ), err


async def test_dead_letter_redrive_refuses_out_and_names_an_offset_that_matches_nothing(
    pipeline_config, tmp_path, capsys
) -> None:
    await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    config = str(write_config(pipeline_config, tmp_path / "config.yaml"))
    code, out, err = await _cli(
        capsys, "--config", config, "dead-letters", "--redrive", "--out", str(tmp_path / "plan.txt")
    )
    assert code == 2 and out == "" and "--redrive prints its plan to stdout" in err, err
    code, out, err = await _cli(capsys, "--config", config, "dead-letters", "--redrive", "--offsets", "0:99,1:3")
    assert code == 0 and "dry run: would redrive 0 of 0" in out, out + err
    assert (
        f"dead-letters: --offsets 0:99, 1:3 match no dead letter read from {pipeline_config.topics.dead_letters} "
        "(0 read)"
    ) in err, err


async def test_a_line_of_another_experiment_is_named_by_file_and_line(pipeline_config, tmp_path, capsys) -> None:
    await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    config = str(write_config(pipeline_config, tmp_path / "config.yaml"))
    first, second = make_group("g-other", 2, turns=1, output_tokens=2)
    path = tmp_path / "mixed.jsonl"
    jsonl.write(path, [first, msgspec.structs.replace(second, experiment_id="exp-other")])
    code, out, err = await _cli(capsys, "--config", config, "publish", str(path))
    assert code == 1 and out == ""
    assert err.startswith(f"error: {path}:2: ") and "names experiment 'exp-other'" in err, err


async def test_two_workers_with_one_id_are_warned(pipeline_config, caplog) -> None:
    view = LedgerView.from_config(pipeline_config.redis)
    first, second, other = Heartbeat("w-twin"), Heartbeat("w-twin"), Heartbeat("w-other")
    try:
        with caplog.at_level(logging.WARNING, logger=heartbeat.__name__):
            for beat in (first, other, second, first, other):
                beat._last = float("-inf")  # due now: the test steps beats, not seconds
                await beat.step(view, ready=True, stopping=False)
    finally:
        await view.aclose()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("worker id 'w-twin' is in use by another live worker" in w for w in warnings)
