"""A dead letter lands on a broker that enforces ``max.message.bytes`` on the compressed batch.

noida-db (the ``bench`` extra, started as tests/integration/test_noida_broker.py does)
checks a topic's ``max.message.bytes`` the way Apache Kafka does: against the whole
record batch as written, after compression. The embedded tansu broker enforces no
limit, so this test runs on noida.

A record of random bytes just under the default limit (1 MiB), sent uncompressed, cannot
be decoded, so the worker dead-letters it. A letter capped so that its record alone
fits the limit (the old sizing) is a batch over the limit once zstd has framed its
incompressible payload: the broker refused it, and the worker only logged a POISON. A
letter capped to :func:`infra.kafka.max_record_size` lands.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.errors import MessageSizeTooLargeError

from infra.config import KafkaConfig, PRMScorerConfig
from infra.kafka import ensure_topics, make_producer, max_record_size, record_size
from infra.local import LOCAL_BROKER_CLIENT, LocalStack
from infra.schema import dead_letter_from_record
from tests.integration.harness import isolated_config, read_topic, running_worker

pytestmark = pytest.mark.integration

LIMIT = 1_048_576  # the default kafka.max_message_bytes (the topics' max.message.bytes)


async def test_the_dead_letter_of_a_near_limit_random_record_lands_on_noida(tmp_path: Path) -> None:
    with LocalStack(tmp_path, broker="noida") as stack:
        defaults = KafkaConfig()  # noida keeps Kafka's group rules: the product's client settings
        kafka = {name: getattr(defaults, name) for name in LOCAL_BROKER_CLIENT} | {
            **stack.client_settings,
            "max_message_bytes": LIMIT,
        }
        cfg = isolated_config(
            f"dl-limit-{uuid.uuid4().hex[:8]}",
            stack.kafka_bootstrap,
            stack.redis_url,
            kafka=kafka,
            dead_letter_max_bytes=LIMIT,
            scorers=[PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 64})],
        )
        assert cfg.kafka.compression == "zstd"
        await ensure_topics(cfg.kafka, cfg.topics)  # max.message.bytes = LIMIT on each topic
        key = f"near-{uuid.uuid4().hex[:6]}".encode()
        headers = [("prm-schema-version", b"1"), ("prm-kind", b"ready")]
        value = b"\xc1" + os.urandom(LIMIT - record_size(key, b"", headers) - 9)  # 0xc1: never valid msgpack
        assert max_record_size(LIMIT) < record_size(key, value, headers) <= LIMIT

        plain = make_producer(cfg.kafka, compression_type=None)  # the batch is the record: under the limit
        zstd = make_producer(cfg.kafka)
        await plain.start()
        await zstd.start()
        try:
            # the broker enforces the limit on the compressed batch: this record, zstd-compressed, is refused
            with pytest.raises(MessageSizeTooLargeError):
                await zstd.send_and_wait(cfg.topics.dead_letters, value, key=b"probe", headers=headers)
            await plain.send_and_wait(cfg.topics.trajectories, value, key=key, headers=headers)
        finally:
            await plain.stop()
            await zstd.stop()

        async with running_worker(cfg, "w-limit") as worker:
            records = await read_topic(
                cfg,
                cfg.topics.dead_letters,
                until=time.monotonic() + 60,
                stop_when=lambda rs: any(r.key == key for r in rs),
            )
            snapshot = worker.telemetry.snapshot()
        assert snapshot["prm_worker_poison_total"] == 0, "the dead letter was refused: logged as POISON"
        (record,) = [r for r in records if r.key == key]
        letter = dead_letter_from_record(record.value, record.headers)
        assert letter.error_class == "InvalidMessage"
        assert letter.original_size == len(value) and value.startswith(letter.payload)
        assert record_size(record.key, record.value, record.headers) <= max_record_size(LIMIT)
        assert len(letter.payload) > LIMIT - 8192
