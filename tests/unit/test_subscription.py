"""Following the registry: the consumer subscribed to each served experiment's topic, once per change."""

from __future__ import annotations

from typing import Any

from infra.registry import RegistryRecord
from scoring_workers.subscription import Subscription
from scoring_workers.telemetry import WorkerTelemetry
from tests.unit.test_fleet import _fleet, _spec


class _Registry:
    """The registry's records: ``backlog`` read at start, ``arriving`` by the next poll."""

    def __init__(self, backlog: list[RegistryRecord]) -> None:
        self.backlog, self.arriving = backlog, list[RegistryRecord]()

    async def start(self) -> None:
        pass

    async def catch_up(self) -> list[RegistryRecord]:
        return self.backlog

    async def poll(self, timeout_ms: int) -> list[RegistryRecord]:
        arrived, self.arriving = self.arriving, []
        return arrived


class _Consumer:
    """Keeps each subscription asked of it."""

    def __init__(self) -> None:
        self.subscriptions: list[list[str]] = []

    def subscription(self) -> set[str]:
        return set(self.subscriptions[-1]) if self.subscriptions else set()

    def subscribe(self, topics: list[str], listener: Any) -> None:
        self.subscriptions.append(topics)


async def test_the_consumer_follows_the_served_topics_and_only_applied_records_are_counted() -> None:
    registry, consumer = _Registry([RegistryRecord("exp-a", _spec("exp-a"), 0)]), _Consumer()
    telemetry = WorkerTelemetry()
    fleet = _fleet()
    subscription = Subscription(registry, fleet, consumer, None, telemetry, "w-unit")  # type: ignore[arg-type]
    await subscription.start()
    assert consumer.subscriptions == [["prm.trajectories", "prm.trajectories.exp-a"]]

    await subscription.follow()  # nothing new: the subscription stands (a change would rebalance the group)
    assert len(consumer.subscriptions) == 1

    registry.arriving = [RegistryRecord("exp-b", _spec("exp-b"), 1), RegistryRecord("exp-x", None, 2, error="not JSON")]
    await subscription.follow()
    assert consumer.subscriptions[-1] == ["prm.trajectories", "prm.trajectories.exp-a", "prm.trajectories.exp-b"]
    snapshot = telemetry.snapshot()
    assert snapshot["prm_worker_registry_records_total{outcome=declared}"] == 2.0
    assert (
        snapshot.get("prm_worker_registry_records_total{outcome=removed}", 0.0) == 0.0
    )  # a record in error: not applied
    assert snapshot["prm_worker_experiments{state=active}"] == 3.0
    await fleet.aclose()
