"""``prm-pipeline dead-letters`` and ``--redrive`` against the embedded broker, Redis and a real worker.

The rules (docs/security.md, "Dead-letter redrive"): a redrive is a dry run unless
``--yes`` and then publishes nothing; ``--yes`` republishes the chosen records (each
printed with its original coordinates) and their group gets its verdict; redriving
twice does not produce a second verdict; records that cannot be helped (cut payload,
still undecodable) are never republished.

Two kinds of dead letter are on the topic:

* one a running worker writes itself: a record of group ``dl-bad`` whose payload is cut
  short (``InvalidMessage``); the worker also rejects ``dl-bad`` (``invalid_member``);
* two that an older worker wrote (built with the worker's own ``capped_letter`` and
  ``dead_letter_headers``) for a key-less record it could not read
  (``UnknownSchemaVersion``): the record decodes with this build, so it is the "after a
  fix" case; the same trajectory twice, as a redelivered record would be.

A streamed session is redriven the same way, record by record: its turns reached the worker,
its ``end`` only an older worker's dead letter; the redriven ``end`` (keyed by its group)
completes the session and its group gets its verdict.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka.structs import ConsumerRecord

from infra.config import PRMScorerConfig
from infra.kafka import ensure_topics, make_producer
from infra.schema import UnknownSchemaVersion, dead_letter_headers, decode_verdict, encode, stream_session
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from scoring_workers.dead_letters import capped_letter
from tests.integration.harness import read_topic, running_worker, wait_for_verdicts, with_scorers, write_config
from tests.polling import eventually

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


async def _old_workers_letter(cfg, value: bytes, headers: list[tuple[str, bytes]], offset: int) -> None:
    """The dead letter a worker writes for a key-less record it could not decode."""
    record = ConsumerRecord(
        topic=cfg.topics.trajectories,
        partition=0,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=value,
        checksum=None,
        serialized_key_size=-1,
        serialized_value_size=len(value),
        headers=headers,
    )
    cause = UnknownSchemaVersion("schema version '1' is not supported (this build reads [0]); upgrade the worker")
    letter, key = capped_letter(
        record,
        cause,
        1,
        worker_id="w-old",
        max_message_bytes=cfg.kafka.max_message_bytes,
        dead_letter_max_bytes=cfg.worker.dead_letter_max_bytes,
    )
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(
            cfg.topics.dead_letters, letter.payload, key=key, headers=dead_letter_headers(letter)
        )
    finally:
        await producer.stop()


async def test_redrive_is_a_dry_run_then_republishes_once(pipeline_config, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="scoring_workers.settling")
    cfg = with_scorers(
        pipeline_config, PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 4})
    )
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    (good,) = make_group("dl-ok", 1, turns=1, output_tokens=3)
    good_value, good_headers = encode(good)
    await _old_workers_letter(cfg, good_value, good_headers, offset=7)
    await _old_workers_letter(cfg, good_value, good_headers, offset=8)  # redelivered, dead-lettered again

    async with running_worker(cfg, "w-redrive"):
        (bad,) = make_group("dl-bad", 1, turns=1, output_tokens=3)
        value, headers = encode(bad)
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            await producer.send_and_wait(
                cfg.topics.trajectories, value[: len(value) // 2], key=b"dl-bad", headers=headers
            )
        finally:
            await producer.stop()
        await wait_for_verdicts(cfg, ["dl-bad"])  # rejected: invalid_member
        letters = await read_topic(
            cfg, cfg.topics.dead_letters, until=time.monotonic() + 30, stop_when=lambda rs: len(rs) >= 3
        )
        assert len(letters) == 3

        # reading: one JSON line each, headers decoded
        listed = await asyncio.to_thread(_cli, config, "dead-letters")
        assert listed.returncode == 0, listed.stderr
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        assert len(rows) == 3 and "3 dead letters" in listed.stderr
        by_class = {r["error_class"]: r for r in rows}
        assert by_class["InvalidMessage"]["worker_id"] == "w-redrive"
        assert by_class["InvalidMessage"]["key"] == "dl-bad" and "decode_error" in by_class["InvalidMessage"]
        assert by_class["InvalidMessage"]["source"].startswith(f"{cfg.topics.trajectories}:")
        old = [r for r in rows if r["error_class"] == "UnknownSchemaVersion"]
        # key-less dead letters land on any partition: the listing's order is the topic's, not the source's
        assert sorted(r["source"] for r in old) == [f"{cfg.topics.trajectories}:0@7", f"{cfg.topics.trajectories}:0@8"]
        assert {r["trajectory_id"] for r in old} == {good.trajectory_id} and old[0]["group_id"] == "dl-ok"
        assert old[0]["original_headers"]["prm-kind"] == "ready"

        # --follow --out: the file fills, Ctrl-C ends it cleanly
        out = tmp_path / "letters.jsonl"
        follow = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prm_pipeline.cli",
                "--config",
                str(config),
                "dead-letters",
                "--follow",
                "--since",
                "1h",
                "--out",
                str(out),
            ],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:

            def wrote_three() -> bool:
                done = out.exists() and len(out.read_text().splitlines()) == 3
                assert done or follow.poll() is None, "--follow exited before writing 3 lines"
                return done

            await eventually(wrote_three, timeout_s=60, interval_s=0.1, what="--follow to write 3 lines")
        finally:
            follow.send_signal(signal.SIGINT)
            _, err = await asyncio.to_thread(follow.communicate, timeout=30)
        assert follow.returncode == 0 and "3 dead letters" in err, err

        before = len(await read_topic(cfg, cfg.topics.trajectories))

        # dry run: the plan, and nothing published
        dry = await asyncio.to_thread(_cli, config, "dead-letters", "--redrive")
        assert dry.returncode == 0, dry.stderr
        lines = dry.stdout.splitlines()
        redrives = [ln for ln in lines if ln.startswith("redrive ")]
        assert len(redrives) == 1 and good.trajectory_id in redrives[0]
        assert "UnknownSchemaVersion: schema version '1' is not supported" in redrives[0]
        # the first of the two letters in the dead-letter topic's order (key-less: any partition)
        first = next(
            f"{cfg.topics.trajectories}:0@{o}"
            for o in (7, 8)
            if f"dead-lettered from {cfg.topics.trajectories}:0@{o} by w-old" in redrives[0]
        )
        skips = [ln for ln in lines if ln.startswith("skip ")]
        assert len(skips) == 2
        assert any("still cannot decode" in ln and "InvalidMessage" in ln for ln in skips)
        assert any("already redriven from" in ln for ln in skips)
        assert "dry run: would redrive 1 of 3" in lines[-1] and "nothing was published" in lines[-1]
        assert len(await read_topic(cfg, cfg.topics.trajectories)) == before
        refused = await asyncio.to_thread(_cli, config, "dead-letters", "--yes")
        assert refused.returncode == 2 and "add --redrive" in refused.stderr

        # --yes: republished with its coordinates, and the group gets its verdict
        done = await asyncio.to_thread(
            _cli, config, "dead-letters", "--redrive", "--yes", "--trajectory", good.trajectory_id
        )
        assert done.returncode == 0, done.stderr
        (sent,) = [ln for ln in done.stdout.splitlines() if ln.startswith("redriven ")]
        assert f"(originally {first}, UnknownSchemaVersion) -> {cfg.topics.trajectories}:" in sent
        assert done.stdout.splitlines()[-1].startswith("redrove 1 of 2 chosen dead letters")
        (verdict,) = [v for v in await wait_for_verdicts(cfg, ["dl-ok"]) if v.group_id == "dl-ok"]
        assert verdict.status == "accepted" and verdict.sessions[0].trajectory_id == good.trajectory_id
        (republished,) = [
            dict(r.headers)
            for r in await read_topic(cfg, cfg.topics.trajectories)
            if "prm-redriven-from" in dict(r.headers)
        ]
        assert republished["prm-redriven-source"] == first.encode()

        # again: the worker acknowledges the trajectory as a duplicate, no second verdict
        again = await asyncio.to_thread(
            _cli, config, "dead-letters", "--redrive", "--yes", "--offsets", _offset_of(rows, 7)
        )
        assert again.returncode == 0 and "redrove 1 of 1" in again.stdout, again.stdout + again.stderr
        await eventually(
            lambda: any(
                "duplicate acknowledged" in r.getMessage() and good.trajectory_id in r.getMessage()
                for r in caplog.records
            ),
            timeout_s=30,
            interval_s=0.1,
            what="the worker to acknowledge the redriven duplicate",
        )
    verdicts = [decode_verdict(r.value, r.headers) for r in await read_topic(cfg, cfg.topics.verdicts)]
    assert [v.group_id for v in verdicts].count("dl-ok") == 1


async def test_redrive_completes_a_streamed_session_whose_end_was_dead_lettered(pipeline_config, tmp_path) -> None:
    """A session's turns were read; its ``end`` was dead-lettered by an older worker that could
    not decode it (key-less, so no group was rejected). ``--redrive --yes`` republishes the
    ``end`` (its payload and headers, keyed by its group) and the group gets its verdict."""
    cfg = with_scorers(
        pipeline_config,
        PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 4}),
        group_timeout_s=600,  # the group is not answered as missing while its end waits for the redrive
    )
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    (traj,) = make_group("dl-stream", 1, turns=2, output_tokens=3)
    turns, end = stream_session(traj)

    async with running_worker(cfg, "w-redrive") as worker:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            for turn in turns:
                await pub.publish_turn(turn)
            await pub.flush()
            # the end as the publisher would send it (end_session), but only in an old worker's dead letter
            ((end_value, end_headers),) = pub.records(end)
        assert dict(end_headers)["prm-kind"] == b"end"
        await _old_workers_letter(cfg, end_value, end_headers, offset=3)
        await eventually(
            lambda: worker.telemetry.consumed.labels("turn")._value.get(),
            accept=lambda n: n >= len(turns),
            timeout_s=30,
            what="the worker to take the session's turns",
        )
        assert not [r for r in await read_topic(cfg, cfg.topics.verdicts) if r.key == b"dl-stream"]

        done = await asyncio.to_thread(_cli, config, "dead-letters", "--redrive", "--yes")
        assert done.returncode == 0, done.stderr
        (sent,) = [ln for ln in done.stdout.splitlines() if ln.startswith("redriven ")]
        assert f"(originally {cfg.topics.trajectories}:0@3, UnknownSchemaVersion) -> " in sent
        assert sent.endswith(f"end of trajectory {traj.trajectory_id} of group dl-stream"), sent
        assert done.stdout.splitlines()[-1].startswith("redrove 1 of 1 chosen dead letters")

        (verdict,) = [v for v in await wait_for_verdicts(cfg, ["dl-stream"]) if v.group_id == "dl-stream"]
        assert verdict.status == "accepted", verdict.reason
        (member,) = verdict.sessions
        assert member.trajectory_id == traj.trajectory_id and member.status == "scored"
    (republished,) = [
        r for r in await read_topic(cfg, cfg.topics.trajectories) if "prm-redriven-from" in dict(r.headers)
    ]
    assert republished.key == b"dl-stream" and republished.value == end_value
    headers = dict(republished.headers)
    assert headers["prm-kind"] == b"end" and headers["prm-redriven-source"] == f"{cfg.topics.trajectories}:0@3".encode()
    assert [k for k, _ in republished.headers][: len(end_headers)] == [k for k, _ in end_headers]


def _offset_of(rows: list[dict], source_offset: int) -> str:
    """``P:O`` of the dead letter whose original record was at ``source_offset``."""
    (row,) = [r for r in rows if r["source"].endswith(f"@{source_offset}")]
    topic_partition, offset = row["dead_letter"].rsplit("@", 1)
    return f"{topic_partition.rsplit(':', 1)[1]}:{offset}"
