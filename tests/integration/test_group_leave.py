"""Leaving a consumer group: leave by session expiry, and a poll that never hangs.

tansu 0.6 (the embedded broker) keeps a departed member as the group's leader when that
leader sends LeaveGroup while a rebalance is forming: no later member is elected and the
group never forms again (this stalled a worker storm in CI). The first test pins that
defect down, which is why ``kafka.leave_group_on_stop`` exists and is false for the
embedded broker; it also checks that our consumer's poll keeps its timeout in such a group
(aiokafka's waits for the group to form, so a worker never saw SIGTERM). The second checks
the option itself.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid

import msgspec
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.group import LeaveGroupRequest

from infra.config import KafkaConfig, TopicsConfig
from infra.kafka import PipelineConsumer, ensure_topics, make_admin, make_consumer
from tests.polling import poll_until

pytestmark = pytest.mark.integration

# A group member in a process of its own, so that it can be frozen (SIGSTOP): it joins,
# prints its member id, then only polls.
MEMBER = """
import asyncio, sys
from aiokafka import AIOKafkaConsumer
async def main():
    c = AIOKafkaConsumer(sys.argv[2], bootstrap_servers=sys.argv[1], group_id=sys.argv[3],
                         session_timeout_ms=10000, heartbeat_interval_ms=500, enable_auto_commit=False)
    await c.start()
    print(c._coordinator.member_id, flush=True)
    while True:
        await c.getmany(timeout_ms=200)
asyncio.run(main())
"""


async def members(admin: AIOKafkaAdminClient, group: str) -> set[str]:
    [response] = await admin.describe_consumer_groups([group])
    [described] = response.groups
    return {m[0] for m in described[5]}  # (member_id, client_id, host, metadata, assignment)


async def test_embedded_broker_stalls_a_group_whose_leader_leaves_mid_rebalance(services) -> None:
    if services.kafka_backend != "embedded":
        pytest.skip("characterizes the embedded broker (tansu 0.6); a real Kafka elects a new leader")
    cfg = KafkaConfig(bootstrap=services.kafka_bootstrap, session_timeout_ms=2000, heartbeat_interval_ms=500)
    topic, group = f"leave-{uuid.uuid4().hex[:8]}", f"leave-g-{uuid.uuid4().hex[:8]}"
    await ensure_topics(cfg, TopicsConfig(partitions=2), [topic])
    admin = make_admin(cfg)
    await admin.start()
    leader = subprocess.Popen(
        [sys.executable, "-c", MEMBER, cfg.bootstrap, topic, group], stdout=subprocess.PIPE, text=True
    )
    member = make_consumer(cfg, topic, group_id=group)  # ours: joins while the group is formed
    joiner = make_consumer(cfg, topic, group_id=group)  # starts the rebalance
    client = AIOKafkaClient(bootstrap_servers=cfg.bootstrap)
    joining: asyncio.Task[None] | None = None
    try:
        leader_id = leader.stdout.readline().strip()  # type: ignore[union-attr]
        assert leader_id, "the leader process did not join"
        await member.start()
        leader.send_signal(signal.SIGSTOP)  # it can neither rejoin nor leave by itself now
        joining = asyncio.create_task(joiner.start())
        joined, _, _ = await poll_until(
            lambda: members(admin, group), accept=lambda m: len(m) == 3, timeout_s=20, interval_s=0.1
        )
        assert joined, "the joiner's JoinGroup never reached the group"
        # The group is forming with the frozen member as its leader; that leader now leaves.
        await client.bootstrap()
        coordinator = await client.coordinator_lookup(0, group)  # 0: a consumer group's coordinator
        await client.send(coordinator, LeaveGroupRequest(group, leader_id))
        leader.kill()

        formed, waited, _ = await poll_until(lambda: joining.done() and bool(joiner.assignment()), timeout_s=8)
        assert not formed, f"the group formed after {waited:.1f}s: tansu now elects a new leader"
        assert leader_id not in await members(admin, group)

        # Our consumer's poll keeps its timeout although its group cannot form (aiokafka's
        # waits for the rebalance to end: here, forever).
        t0 = time.monotonic()
        polled = await asyncio.wait_for(member.getmany(timeout_ms=200), 5)  # TimeoutError: the poll hung
        assert polled == {} and time.monotonic() - t0 < 2.0
        joining.cancel()
        await asyncio.wait_for(asyncio.gather(member.stop(), joiner.stop()), 15)  # a worker's exit path
    finally:
        if joining is not None:
            joining.cancel()
        await joiner.stop()
        if leader.poll() is None:
            leader.kill()
        leader.wait()
        await client.close()
        await admin.close()


async def test_leave_group_on_stop_false_ends_membership_by_session_expiry(kafka_bootstrap) -> None:
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, session_timeout_ms=2000, heartbeat_interval_ms=500)
    topic, group = f"leave-{uuid.uuid4().hex[:8]}", f"leave-g-{uuid.uuid4().hex[:8]}"
    await ensure_topics(cfg, TopicsConfig(partitions=2), [topic])
    admin = make_admin(cfg)
    await admin.start()
    staying = make_consumer(msgspec.structs.replace(cfg, leave_group_on_stop=True), topic, group_id=group)
    quiet = make_consumer(msgspec.structs.replace(cfg, leave_group_on_stop=False), topic, group_id=group)
    assert isinstance(quiet, PipelineConsumer) and not quiet.leave_group_on_stop
    try:
        await staying.start()
        await quiet.start()
        # a later generation, so that a leaving member would send LeaveGroup at all
        both, _, _ = await poll_until(
            lambda: members(admin, group), accept=lambda m: len(m) == 2, timeout_s=20, interval_s=0.1
        )
        assert both
        before = await members(admin, group)
        quiet_id = quiet._coordinator.member_id
        await quiet.stop()
        assert quiet_id in await members(admin, group), "LeaveGroup was sent although leave_group_on_stop=False"
        expired, waited, _ = await poll_until(
            lambda: members(admin, group),
            accept=lambda m: quiet_id not in m,
            timeout_s=15,
            between=lambda: staying.getmany(timeout_ms=100),
        )
        assert expired, f"the stopped member never expired: {before}"
        assert waited >= 1.0  # by expiry (2 s session), not at once
    finally:
        await staying.stop()
        await admin.close()
