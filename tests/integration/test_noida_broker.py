"""The benchmarks' second broker (``--broker noida``, the ``bench`` extra) and the counting proxy in front of it.

noida-db advertises the address it listens on, so ``bench capacity``'s proxy rewrites
the broker's port in Metadata/FindCoordinator answers: a client that bootstraps through
the proxy must then produce, join a group and fetch through it too.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from infra.local import LocalStack, LocalStackError
from tests.polling import poll_until

pytestmark = pytest.mark.integration


def test_unknown_embedded_broker_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LocalStackError, match="unknown embedded broker 'kafka'"):
        LocalStack(tmp_path, broker="kafka")


async def test_noida_behind_the_counting_proxy(tmp_path: Path) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from tests.perf.kafka_proxy import KafkaCountingProxy

    with LocalStack(tmp_path, broker="noida") as stack:
        assert stack.client_settings == {}  # Kafka's group rules: the product defaults apply
        proxy = KafkaCountingProxy(stack.broker.port).start()
        try:
            bootstrap = f"127.0.0.1:{proxy.port}"
            topic = f"proxy-{uuid.uuid4().hex[:8]}"
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)  # our clients never auto-create a topic
            await admin.start()
            try:
                await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
            finally:
                await admin.close()
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
            await producer.start()
            try:
                assert {(b.host, b.port) for b in producer.client.cluster.brokers()} == {("127.0.0.1", proxy.port)}
                for i in range(5):
                    await producer.send_and_wait(topic, f"r{i}".encode())
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(
                topic,
                bootstrap_servers=bootstrap,
                group_id=f"g-{topic}",
                auto_offset_reset="earliest",
                enable_auto_commit=False,
            )
            await consumer.start()
            try:
                got: list[bytes] = []

                async def read() -> None:
                    for records in (await consumer.getmany(timeout_ms=100)).values():
                        got.extend(r.value for r in records)

                await poll_until(lambda: len(got) >= 5, timeout_s=10, between=read)
                await consumer.commit()  # through the group coordinator the proxy advertised
            finally:
                await consumer.stop()
            assert got == [f"r{i}".encode() for i in range(5)]
            assert proxy.rewrites >= 2  # metadata, and the coordinator
            assert proxy.bytes_in > 0 and proxy.bytes_out > 0
        finally:
            proxy.stop()
