"""What a worker consumes: every served experiment's trajectories topic, kept in step with the registry.

At start the whole experiment registry is read (:meth:`~scoring_workers.fleet.Fleet.settle`:
every declared experiment is known before the first trajectory is read; one removed
longer ago than its group timeout is not served again) and the consumer subscribed.
Then the registry is followed (a background step of the worker's loop): each record is
applied to the :class:`~scoring_workers.fleet.Fleet` as it comes, removed experiments
retire in time, and a change of the served topics changes the subscription (the
consumer group rebalances; ``listener`` hears of it).
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

from infra.registry import RegistryFollower, RegistryRecord
from scoring_workers.fleet import Fleet
from scoring_workers.telemetry import WorkerTelemetry

log = logging.getLogger(__name__)

REGISTRY_POLL_MS = 2000  # the registry follower's poll (it returns as soon as a record arrives)


class Subscription:
    """One worker's experiments, followed from the ``registry``, and its consumer's subscription to them."""

    def __init__(
        self,
        registry: RegistryFollower,
        fleet: Fleet,
        consumer: AIOKafkaConsumer,
        listener: ConsumerRebalanceListener,
        telemetry: WorkerTelemetry,
        worker_id: str,
    ) -> None:
        self.fleet = fleet
        self.consumer = consumer
        self._listener = listener
        self._telemetry = telemetry
        self.worker_id = worker_id
        self._registry = registry

    async def start(self) -> None:
        """Read the whole registry, then subscribe to what it leaves served."""
        await self._registry.start()
        for entry in self.fleet.settle(await self._registry.catch_up()):
            await self._apply_registry(entry)
        self.fleet.expire()
        self._subscribe()

    async def follow(self) -> None:
        """Apply what the registry says as it says it; retire removed experiments in time."""
        for entry in await self._registry.poll(timeout_ms=REGISTRY_POLL_MS):
            await self._apply_registry(entry)
        self.fleet.expire()
        self._subscribe()

    async def aclose(self) -> None:
        await self._registry.aclose()

    def _subscribe(self) -> None:
        """Consume every served experiment's trajectories topic (a change rebalances the group)."""
        topics = self.fleet.topics()
        if set(topics) != self.consumer.subscription():
            self.consumer.subscribe(topics, listener=self._listener)
            log.info("worker %s consumes %s", self.worker_id, topics)
        for state, count in self.fleet.states().items():
            self._telemetry.experiments.labels(state).set(count)

    async def _apply_registry(self, entry: RegistryRecord) -> None:
        await self.fleet.apply(entry)
        if not entry.error:
            self._telemetry.registry_records.labels("removed" if entry.removal else "declared").inc()
