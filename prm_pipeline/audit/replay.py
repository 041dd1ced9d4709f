"""Replaying the trajectories and verdicts topics without touching production offsets.

:func:`read_snapshot` reads one topic with a throw-away, group-less consumer (no
consumer group joined, nothing committed) up to the end each partition had when
reading began, starting at ``--from-offsets`` positions or at ``--since``;
:func:`parse_offsets` parses the ``--from-offsets`` syntax. :class:`AuditError` is
what makes an audit unable to run (a missing topic, an unknown partition, ...).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from infra.config import PipelineConfig
from infra.errors import PRMPipelineError


class AuditError(PRMPipelineError, RuntimeError):
    """The audit cannot run (a topic is missing, an offset names no partition, ...)."""


# =========================================================================== Kafka
def parse_offsets(text: str | Iterable[str], *, aliases: Mapping[str, str] | None = None) -> dict[str, dict[int, int]]:
    """``"topic:partition:offset,..."`` -> ``{topic: {partition: offset}}``.

    ``aliases`` maps short names (``trajectories``, ``verdicts``) to topic names.
    """
    items = [text] if isinstance(text, str) else list(text)
    out: dict[str, dict[int, int]] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            try:
                topic, partition, offset = part.rsplit(":", 2)
                p, o = int(partition), int(offset)
            except ValueError:
                raise ValueError(f"bad offset {part!r}: expected TOPIC:PARTITION:OFFSET") from None
            if p < 0 or o < 0 or not topic:
                raise ValueError(f"bad offset {part!r}: partition and offset must be >= 0")
            topic = (aliases or {}).get(topic, topic)
            out.setdefault(topic, {})[p] = o
    return out


async def read_snapshot(
    cfg: PipelineConfig,
    topic: str,
    *,
    start: Mapping[int, int] | None = None,
    since_ms: int | None = None,
    on_total: Callable[[int], None] | None = None,
    ends_out: dict[int, int] | None = None,
) -> AsyncIterator[Any]:
    """Every record of ``topic`` up to the end each partition had when reading began.

    A group-less consumer (nothing committed, no group joined) starts each partition at
    ``start[partition]``, else at the first record at/after ``since_ms``, else at the
    beginning; records older than ``since_ms`` are skipped. The end of a partition is
    the first ``highwater()`` seen after a fetch (the embedded broker's ``end_offsets``
    is wrong), so records produced while the audit runs are left for the next one.
    ``on_total`` receives the number of records in range as partition ends become
    known; ``ends_out`` receives ``{partition: end}`` (for ``--from-offsets`` later).
    """
    from aiokafka.structs import TopicPartition

    from infra.kafka import make_consumer
    from prm_pipeline.verdict_dump import seek_to_time

    consumer = make_consumer(cfg.kafka, group_id=None)
    await consumer.start()
    try:
        if topic not in await consumer.topics():
            raise AuditError(f"topic {topic!r} does not exist on {cfg.kafka.bootstrap}")
        partitions = consumer.partitions_for_topic(topic) or set()
        unknown = sorted(set(start or {}) - partitions)
        if unknown:
            raise AuditError(f"--from-offsets names partitions {unknown} of {topic!r}, which has {sorted(partitions)}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        if since_ms is not None:
            await seek_to_time(consumer, tps, since_ms)
        for tp in tps:
            if start and tp.partition in start:
                consumer.seek(tp, start[tp.partition])
        first = {tp: await consumer.position(tp) for tp in tps}
        ends: dict[Any, int] = {}
        done: set[Any] = set()
        stall_s = max(30.0, cfg.kafka.request_timeout_ms / 1000 * 2)
        last_progress = time.monotonic()
        while len(done) < len(tps):
            batch = await consumer.getmany(timeout_ms=200, max_records=1000)
            if (
                batch
                or len(ends) < len(tps)
                and any(consumer.highwater(tp) is not None for tp in tps if tp not in ends)
            ):
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > stall_s:
                stuck = sorted(tp.partition for tp in tps if tp not in done)
                raise AuditError(
                    f"no progress reading {topic!r} partitions {stuck} for {stall_s:.0f}s "
                    "(broker unreachable, or it reports no high watermark)"
                )
            for tp in tps:
                if tp not in ends and (high := consumer.highwater(tp)) is not None:
                    ends[tp] = max(high, first[tp])
                    if ends_out is not None:
                        ends_out[tp.partition] = ends[tp]
                    if on_total is not None:
                        on_total(ends[tp] - first[tp])
            for tp, records in batch.items():
                end = ends.get(tp)
                for record in records:
                    if end is not None and record.offset >= end:
                        break
                    if since_ms is not None and record.timestamp < since_ms:
                        yield None  # counted for progress, not audited
                        continue
                    yield record
            for tp in tps:
                if tp not in done and tp in ends and await consumer.position(tp) >= ends[tp]:
                    done.add(tp)
                    consumer.pause(tp)
    finally:
        await consumer.stop()
