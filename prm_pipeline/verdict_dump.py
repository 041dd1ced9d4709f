"""``prm-pipeline verdicts``: print verdicts as JSON lines (format in docs/jsonl.md).

Reads with a throw-away consumer (no consumer group, nothing committed), so dumping
never disturbs the trainer's offsets. "Only new verdicts" is implemented as "records
timestamped after start-up", read from the beginning: the embedded broker reports
wrong end offsets, and timestamps work the same on every broker.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import IO

import msgspec

from infra.config import PipelineConfig
from infra.jsonl import dump_verdict
from infra.kafka import make_consumer
from infra.schema import SchemaError, decode_verdict


async def _dump(cfg: PipelineConfig, out: IO[str], *, from_beginning: bool, max_count: int | None,
                timeout_s: float | None, since_ms: int | None = None) -> int:
    start_ms = since_ms if since_ms is not None else (0 if from_beginning else int(time.time() * 1000))
    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    count = 0
    try:
        partitions = consumer.partitions_for_topic(cfg.topics.verdicts)
        while partitions is None:  # metadata not loaded yet
            await consumer._client.force_metadata_update()  # noqa: SLF001 - aiokafka has no public call
            partitions = consumer.partitions_for_topic(cfg.topics.verdicts)
        from aiokafka.structs import TopicPartition

        consumer.assign([TopicPartition(cfg.topics.verdicts, p) for p in sorted(partitions)])
        await consumer.seek_to_beginning()
        last_new = time.monotonic()
        encoder = msgspec.json.Encoder()
        while max_count is None or count < max_count:
            batch = await consumer.getmany(timeout_ms=200)
            records = [r for rs in batch.values() for r in rs]
            if not records and timeout_s is not None and time.monotonic() - last_new > timeout_s:
                break
            for record in records:
                if record.timestamp < start_ms:
                    continue
                try:
                    verdict = decode_verdict(record.value, record.headers)
                except SchemaError as exc:
                    print(f"skipping undecodable verdict at {record.partition}:{record.offset}: {exc}", file=sys.stderr)
                    continue
                out.write(encoder.encode(dump_verdict(verdict)).decode() + "\n")
                count += 1
                last_new = time.monotonic()
                if max_count is not None and count >= max_count:
                    break
            out.flush()
    finally:
        await consumer.stop()
    return count


def dump_verdicts(cfg: PipelineConfig, *, from_beginning: bool, max_count: int | None, timeout_s: float | None,
                  out: str | None, since_ms: int | None = None) -> int:
    fh = open(out, "w") if out else sys.stdout
    try:
        n = asyncio.run(_dump(cfg, fh, from_beginning=from_beginning, max_count=max_count, timeout_s=timeout_s,
                              since_ms=since_ms))
    except KeyboardInterrupt:
        return 130
    finally:
        if out:
            fh.close()
    print(f"{n} verdicts", file=sys.stderr)
    return 0
