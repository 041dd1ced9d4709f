"""A dead letter of an incompressible record just under ``kafka.max_message_bytes`` fits
the limit as the broker counts it: the whole record batch, zstd-compressed (the producer's
default), built by aiokafka's own record builder."""

from __future__ import annotations

import os

from aiokafka.record.default_records import DefaultRecordBase, DefaultRecordBatchBuilder
from aiokafka.structs import ConsumerRecord

from infra.kafka import max_record_size, record_size
from infra.schema import dead_letter_headers
from scoring_workers.dead_letters import capped_letter

LIMIT = 1_048_576  # the default kafka.max_message_bytes


def _zstd_batch(key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> bytes:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=DefaultRecordBase.CODEC_ZSTD,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=16_384,
    )
    assert builder.append(0, timestamp=None, key=key, value=value, headers=headers) is not None
    return bytes(builder.build())


def test_the_dead_letter_of_a_near_limit_random_record_fits_once_compressed() -> None:
    key, headers = b"near-limit", [("prm-schema-version", b"1"), ("prm-kind", b"ready")]
    value = os.urandom(LIMIT - record_size(key, b"", headers) - 8)
    assert record_size(key, value, headers) <= LIMIT
    record = ConsumerRecord("traj", 3, 1234, 0, 0, key, value, None, len(key), len(value), headers)
    letter, letter_key = capped_letter(
        record, ValueError("not msgpack"), 1, worker_id="w", max_message_bytes=LIMIT, dead_letter_max_bytes=LIMIT
    )
    letter_headers = dead_letter_headers(letter)
    assert len(_zstd_batch(letter_key, letter.payload, letter_headers)) <= LIMIT  # what the broker checks
    assert record_size(letter_key, letter.payload, letter_headers) <= max_record_size(LIMIT)
    assert letter.original_size == len(value) and value.startswith(letter.payload)
    assert len(letter.payload) > LIMIT - 8192  # capped by the room the batch needs, not much more
