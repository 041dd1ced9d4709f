"""The consumers' adaptive fetch wait against the embedded broker (infra.kafka.AdaptiveFetchWait).

An idle consumer must end up asking the broker at the long wait (cheap idling) and drop
to the short one as soon as a fetch brings records (latency under load), and the wait
must be the one aiokafka actually puts into its fetch requests.
"""

from __future__ import annotations

import uuid

from infra.aiokafka_internals import fetch_wait_ms
from infra.config import KafkaConfig, TopicsConfig
from infra.kafka import AdaptiveFetchWait, ensure_topics, make_consumer, make_producer
from tests.polling import eventually


class _Recording(AdaptiveFetchWait):
    """Keeps (fetch brought records, wait of the next fetch) for every fetch."""

    __slots__ = ("seen",)

    def __init__(self, low_ms: int, high_ms: int) -> None:
        super().__init__(low_ms, high_ms)
        self.seen: list[tuple[bool, int]] = []

    def after_fetch(self, got_records: bool) -> int:
        self.seen.append((got_records, wait := super().after_fetch(got_records)))
        return wait


async def test_fetch_wait_grows_while_idle_and_drops_when_records_come(kafka_bootstrap) -> None:
    cfg = KafkaConfig(
        bootstrap=kafka_bootstrap,
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
        leave_group_on_stop=False,
        fetch_min_wait_ms=5,
        fetch_max_wait_ms=80,
    )
    topic = f"fetchwait-{uuid.uuid4().hex[:8]}"
    await ensure_topics(cfg, TopicsConfig(partitions=2), [topic])
    consumer = make_consumer(cfg, topic, group_id=f"fw-{uuid.uuid4().hex[:8]}")
    assert (consumer.fetch_wait.low_ms, consumer.fetch_wait.high_ms) == (5, 80)
    consumer.fetch_wait = recording = _Recording(5, 80)
    seen = recording.seen
    producer = make_producer(cfg)
    await consumer.start()
    await producer.start()
    try:
        await eventually(
            lambda: bool(seen) and seen[-1] == (False, 80),
            timeout_s=20,  # idle: doubled up to the long wait
            between=lambda: consumer.getmany(timeout_ms=100),
            what=lambda: f"the wait to reach 80 ms while idle: {seen[-8:]}",
        )
        assert fetch_wait_ms(consumer) == 80  # what the next FetchRequest carries
        assert [w for _, w in seen[:4]] == [10, 20, 40, 80]  # a fresh topic: doubling from 5 ms

        await producer.send_and_wait(topic, b"x", key=b"k")
        got: list[object] = []

        async def read() -> None:
            got.extend(r for rs in (await consumer.getmany(timeout_ms=100)).values() for r in rs)

        await eventually(lambda: got, between=read, timeout_s=20, what="the record")
        assert (True, 5) in seen[seen.index((False, 80)) :]  # the fetch that brought it reset the wait
    finally:
        await producer.stop()
        await consumer.stop()


async def test_an_override_bounds_the_adaptive_wait(kafka_bootstrap) -> None:
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, fetch_min_wait_ms=5, fetch_max_wait_ms=100)
    consumer = make_consumer(cfg, group_id=None, fetch_max_wait_ms=10)
    assert (consumer.fetch_wait.low_ms, consumer.fetch_wait.high_ms) == (5, 10)
    fixed = make_consumer(cfg, group_id=None, fetch_min_wait_ms=50, fetch_max_wait_ms=50)
    assert (fixed.fetch_wait.low_ms, fixed.fetch_wait.high_ms) == (50, 50)
    await consumer.stop()
    await fixed.stop()
