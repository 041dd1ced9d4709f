"""The embedded stack and the Kafka/Redis plumbing against the real servers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import msgspec
import pytest

from infra.config import load_config
from infra.kafka import (
    MessageTooLarge,
    check_size,
    ensure_topics,
    make_consumer,
    make_producer,
    max_record_size,
    record_size,
)
from infra.local import LOCAL_BROKER_ENV, LocalStack, LocalStackError
from infra.redis import make_redis
from infra.schema import decode_message, encode
from prm_pipeline.demo.synthetic import make_group
from tests.polling import poll_until

pytestmark = pytest.mark.integration


async def test_topics_create_is_idempotent(pipeline_config) -> None:
    first = await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    second = await ensure_topics(pipeline_config.kafka, pipeline_config.topics)
    assert {s.state for s in first.values()} == {"created"}
    assert {s.state for s in second.values()} == {"exists"}
    assert set(first) == {
        pipeline_config.topics.trajectories,
        pipeline_config.topics.verdicts,
        pipeline_config.topics.dead_letters,
        pipeline_config.topics.experiments,
    }


async def test_trajectories_round_trip_through_the_broker(pipeline_config) -> None:
    cfg = pipeline_config
    await ensure_topics(cfg.kafka, cfg.topics)
    sent = make_group("g-rt", 3, turns=2, output_tokens=300)
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        for traj in sent:
            value, headers = encode(traj)
            await producer.send(cfg.topics.trajectories, value, key=traj.group_id.encode(), headers=headers)
        await producer.flush()
    finally:
        await producer.stop()
    consumer = make_consumer(cfg.kafka, cfg.topics.trajectories, group_id=f"{cfg.worker.group_id}-rt")
    await consumer.start()
    got = []
    try:

        async def read() -> None:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                got.extend((r.key, decode_message(r.value, r.headers)) for r in records)

        await poll_until(lambda: len(got) >= len(sent), timeout_s=20, between=read)
    finally:
        await consumer.stop()
    assert sorted(t.trajectory_id for _, t in got) == sorted(t.trajectory_id for t in sent)
    assert {key for key, _ in got} == {b"g-rt"}  # keyed by group: one partition per group
    by_id = {t.trajectory_id: t for _, t in got}
    for original in sent:
        back = by_id[original.trajectory_id]
        assert msgspec.msgpack.encode(back) == msgspec.msgpack.encode(original)
        assert (
            back.interactions[1].model_response.output_tokens.tolist()
            == original.interactions[1].model_response.output_tokens.tolist()
        )


async def test_redis_answers(pipeline_config) -> None:
    redis = make_redis(pipeline_config.redis)
    try:
        key = f"{pipeline_config.redis.key_prefix}:probe"
        assert await redis.set(key, b"v", ex=10)
        assert await redis.get(key) == b"v"
        assert 0 < await redis.ttl(key) <= 10
    finally:
        await redis.aclose()


def test_size_limit_is_enforced_client_side(pipeline_config) -> None:
    cfg = msgspec.structs.replace(pipeline_config.kafka, max_message_bytes=2048)
    safe = max_record_size(2048, cfg.compression)  # room for the batch framing and compression's worst case
    n = max(n for n in range(2048) if record_size(None, b"x" * n, None) <= safe)
    check_size(b"x" * n, cfg, "record")
    with pytest.raises(
        MessageTooLarge, match=f"{safe + 1} bytes, over the {safe} a record may have under kafka.max_message_bytes=2048"
    ):
        check_size(b"x" * (n + 1), cfg, "record")


def test_missing_binary_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(LocalStackError, match="local.broker_binary .* is not an executable file"):
        LocalStack(tmp_path, broker_binary=str(tmp_path / "nope"))


def test_failed_start_reports_the_log(tmp_path) -> None:
    fake = tmp_path / "fake-broker"
    fake.write_text("#!/bin/sh\necho 'cannot bind: simulated' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(LocalStackError, match="(?s)exited with code 3.*cannot bind: simulated"):
        LocalStack(tmp_path, broker_binary=str(fake)).start()


def test_cli_up_prints_endpoints_and_stops_on_sigterm(tmp_path) -> None:
    env = {**os.environ, "PRM_LOCAL_DATA_DIR": str(tmp_path)}
    stderr_path = tmp_path / "up.stderr"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prm_pipeline.cli", "up", "--create-topics"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )

    def diagnosis() -> str:  # what `up` and the services said, for a failure message
        logs = [stderr_path, *sorted((tmp_path / "logs").glob("*.log"))]
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in logs if p.exists())

    try:
        first = proc.stdout.readline().strip()
        second = proc.stdout.readline().strip()
        third = proc.stdout.readline().strip()
        assert first.startswith("PRM_KAFKA_BOOTSTRAP=127.0.0.1:"), diagnosis()
        assert second.startswith("PRM_REDIS_URL=redis://127.0.0.1:") and second.endswith("/0"), diagnosis()
        # the settings this broker needs, in the form the config loader reads
        settings = [third] + [proc.stdout.readline().strip() for _ in range(len(LOCAL_BROKER_ENV) - 1)]
        assert settings == [f"{k}={v}" for k, v in LOCAL_BROKER_ENV.items()], diagnosis()
        assert third == "PRM_KAFKA_LEAVE_GROUP_ON_STOP=false", diagnosis()
        kafka = load_config(environ=dict(line.split("=", 1) for line in settings)).kafka
        assert not kafka.leave_group_on_stop and (kafka.fetch_min_wait_ms, kafka.fetch_max_wait_ms) == (5, 20)
        said = stderr_path.read_text()  # --create-topics says which topics it created (stdout stays eval-able)
        for topic in ("prm.trajectories", "prm.verdicts", "prm.dead-letters", "prm.experiments"):
            assert f"# created  {topic}\n" in said, diagnosis()
        port = int(second.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert s.recv(16).startswith(b"+PONG")
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`prm-pipeline up` still running 15 s after SIGTERM\n{diagnosis()}")
        assert code == 0, diagnosis()
        assert "stopped both in" in stderr_path.read_text()
        with pytest.raises(OSError):  # Redis went with it
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
