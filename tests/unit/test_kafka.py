"""The size a record may have under ``kafka.max_message_bytes`` (:func:`infra.kafka.max_record_size`),
checked against record batches as aiokafka really writes them.

A broker checks ``max.message.bytes`` against the whole batch — its header and the
records after compression — and compression grows incompressible bytes: a record sized to
the limit itself (the old sizing) becomes a batch over it, one at
:func:`~infra.kafka.max_record_size` never does.
"""

from __future__ import annotations

import os

import pytest
from aiokafka.codec import gzip_encode, lz4_encode, zstd_encode
from aiokafka.record.default_records import DefaultRecordBase, DefaultRecordBatchBuilder

from infra.config import KafkaConfig
from infra.kafka import (
    COMPRESSIONS,
    RECORD_BATCH_HEADER,
    compress_bound,
    make_producer,
    max_record_size,
    record_size,
)

CODECS = {
    "none": DefaultRecordBase.CODEC_NONE,
    "gzip": DefaultRecordBase.CODEC_GZIP,
    "lz4": DefaultRecordBase.CODEC_LZ4,
    "zstd": DefaultRecordBase.CODEC_ZSTD,
}
ENCODERS = {"gzip": gzip_encode, "lz4": lz4_encode, "zstd": zstd_encode}
KEY = b"group-0001"
HEADERS = [("prm-schema-version", b"1"), ("prm-kind", b"ready")]


def _batch(compression: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> bytes:
    """The record batch a producer writes for this record alone (aiokafka's own builder, the
    compiled one its producer uses: it sends the compressed block even when that is larger)."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=CODECS[compression],
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=16_384,
    )
    assert builder.append(0, timestamp=None, key=key, value=value, headers=headers) is not None
    return bytes(builder.build())


def _incompressible(size: int) -> bytes:
    """Random bytes whose record (:data:`KEY`, :data:`HEADERS`) has ``record_size`` exactly ``size``
    (or 1 byte less, where a length varint grows by a byte there)."""
    n = size - record_size(KEY, b"", HEADERS)
    while n > 0 and record_size(KEY, bytes(n), HEADERS) > size:
        n -= 1
    value = os.urandom(n)
    assert size - 1 <= record_size(KEY, value, HEADERS) <= size
    return value


def test_the_batch_header_is_aiokafkas() -> None:
    assert RECORD_BATCH_HEADER == DefaultRecordBase.HEADER_STRUCT.size == 61
    # record_size counts the header and the most framing a record can have
    assert record_size(None, b"", None) >= len(_batch("none", None, b"", []))


@pytest.mark.parametrize("compression", ["zstd", "lz4", "gzip"])
def test_compress_bound_holds_for_random_bytes(compression: str) -> None:
    for size in (0, 1, 100, 4_095, 65_536, 65_537, 131_071, 131_072, 131_073, 1_000_000, 1_048_576):
        data = os.urandom(size)
        assert len(ENCODERS[compression](data)) <= compress_bound(size, compression), (compression, size)


def test_zstd_has_the_largest_bound_so_it_is_the_default() -> None:
    for size in [*range(0, 300_000, 997), 1_048_576, 8 << 20, 100 << 20]:
        zstd = compress_bound(size)
        assert all(compress_bound(size, c) <= zstd for c in COMPRESSIONS), size
    assert max_record_size(1_048_576) == max_record_size(1_048_576, "zstd")
    assert all(max_record_size(1_048_576, c) >= max_record_size(1_048_576) for c in COMPRESSIONS)


def test_max_record_size_is_the_largest_size_within_the_bound() -> None:
    for limit in (1024, 2048, 65_536, 1_048_575, 1_048_576, 1_048_588, 8 << 20):
        for compression in COMPRESSIONS:
            safe = max_record_size(limit, compression)
            assert RECORD_BATCH_HEADER + compress_bound(safe - RECORD_BATCH_HEADER, compression) <= limit
            assert RECORD_BATCH_HEADER + compress_bound(safe + 1 - RECORD_BATCH_HEADER, compression) > limit
    assert max_record_size(1_048_576, "none") == 1_048_576
    assert max_record_size(1_048_576) == 1_044_497  # 4,079 bytes of room: 1 MiB / 257, rounded
    assert max_record_size(60) == 0
    with pytest.raises(ValueError, match="unknown compression 'snappy'"):
        max_record_size(1_048_576, "snappy")


@pytest.mark.parametrize("compression", ["zstd", "lz4", "gzip"])
def test_a_record_at_the_safe_size_fits_where_one_at_the_limit_does_not(compression: str) -> None:
    limit = 1_048_576  # the default kafka.max_message_bytes
    safe = max_record_size(limit, compression)
    assert len(_batch(compression, KEY, _incompressible(safe), HEADERS)) <= limit
    # the old sizing: record_size == the limit; compressed, the batch is over it and a broker refuses it
    assert len(_batch(compression, KEY, _incompressible(limit), HEADERS)) > limit


@pytest.mark.parametrize("limit", [1024, 16_384, 65_536, 1_048_588, 4 << 20])
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_safe_records_fit_at_every_limit(limit: int, compression: str) -> None:
    safe = max_record_size(limit, compression)
    for headers in (HEADERS, []):
        value = os.urandom(max(0, safe - record_size(KEY, b"", headers) - 8))
        assert record_size(KEY, value, headers) <= safe
        assert len(_batch(compression, KEY, value, headers)) <= limit


async def test_the_producer_batches_at_most_what_fits_once_compressed() -> None:
    """Several small records share a batch up to ``max_batch_size`` before compression;
    under a small limit that is cut to :func:`max_record_size`."""
    small = make_producer(KafkaConfig(max_message_bytes=4096))
    default = make_producer(KafkaConfig())
    try:
        assert small._message_accumulator._batch_size == max_record_size(4096) < 4096
        assert default._message_accumulator._batch_size == 16_384
    finally:
        for producer in (small, default):
            producer._closed = True  # never started: nothing to stop
