"""``TrajectoryPublisher``: how a rollout proxy hands trajectories to the pipeline.

A session goes out whole (``publish_ready``) or turn by turn as the agent produces it
(``publish_turn`` for each turn, then ``end_session``): a streamed session's judge work
starts with its turns instead of after its last one (docs/wire.md, "Streamed sessions").

Records are keyed by ``group_id`` (all members of a group land in one partition, in
order with the group's discard; a streamed session's turns and end, being one member's,
stay in the order they were sent), sent with ``acks=all`` and compression, and checked
against ``kafka.max_message_bytes`` before sending (:func:`infra.kafka.max_record_size`:
room left for the batch header and compression's worst case) — the embedded broker
enforces no limit, a real cluster would refuse the record after the fact.

Trajectories go out in the compact form (each turn carries only what is new since its
parent, schema version 2), and one too large for a record is split into chunk records
(:func:`infra.chunks.to_records`): a long agent session costs its content, not the
square of its turns. Only a session over :data:`infra.schema.MAX_CHUNKS` records is
refused, with :class:`infra.kafka.MessageTooLarge` naming it.

One publisher serves one experiment (docs/fleet.md): it stamps ``experiment_id`` on
every ready trajectory and discard that names none, and sends to that experiment's
topic, ``<topics.trajectories>.<experiment>``. The default experiment stamps nothing and
keeps ``topics.trajectories``, so its records are byte for byte what they were before
experiments existed. A message that names another experiment is refused
(:class:`infra.schema.ExperimentMismatch`, a ``ValueError``) before anything is sent: the topic is the
tenant, and a worker dead-letters a record that names another experiment than its topic's.

Retries are bounded: the client retries retriable send errors (leader changes,
disconnects) with backoff until ``kafka.request_timeout_ms`` runs out, then the delivery
fails. ``publish_ready``/``discard_group`` return once the record is queued; ``flush()``
waits until every queued record is acknowledged and raises the first delivery error,
so a caller that awaits ``flush()`` (or leaves the ``async with`` block) knows nothing
was lost.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from aiokafka import AIOKafkaProducer

from infra import jsonl
from infra.chunks import Record, to_records
from infra.config import KafkaConfig, TopicsConfig
from infra.errors import ServiceError
from infra.experiments import DEFAULT_EXPERIMENT, check_experiment_id, trajectories_topic
from infra.kafka import make_producer, require_topics
from infra.schema import (
    DiscardGroup,
    ExperimentMismatch,
    ReadyTrajectory,
    SessionEnd,
    SessionTurn,
    TrajectoryMessage,
    check_channel,
    kind_of,
)
from infra.turns import TurnCompactor


class PublishError(ServiceError, RuntimeError):
    """One or more records were not acknowledged by the broker."""


class TrajectoryPublisher:
    """Async context manager publishing :class:`ReadyTrajectory`, :class:`DiscardGroup` and
    the :class:`SessionTurn` / :class:`SessionEnd` records of streamed sessions."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        *,
        max_pending: int = 10_000,
        experiment: str = DEFAULT_EXPERIMENT,
    ) -> None:
        self.kafka = kafka
        self.experiment = check_experiment_id(experiment)
        self.topic = trajectories_topic(topics.trajectories, experiment)
        self._producer: AIOKafkaProducer | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self._errors: list[BaseException] = []
        self._max_pending = max_pending
        self.published = {"ready": 0, "discard": 0, "turn": 0, "end": 0}
        self._turns = TurnCompactor()
        self.records_sent = 0  # Kafka records (a chunked trajectory is several)

    async def __aenter__(self) -> TrajectoryPublisher:
        await self.start()
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        try:
            if exc_type is None:
                await self.flush()
        finally:
            await self.aclose()

    async def start(self) -> None:
        """Start the producer once the topic is known to exist: a missing one is
        :class:`infra.kafka.TopicMissing` (one line with the fix), never created by a send."""
        await require_topics(self.kafka, [self.topic])
        self._producer = make_producer(self.kafka)
        await self._producer.start()

    async def aclose(self) -> None:
        """Close the producer (call :meth:`flush` first to wait for queued sends); :meth:`start` may follow."""
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    def records(self, message: TrajectoryMessage) -> list[Record]:
        """The Kafka records (``(value, headers)``, key = ``group_id``) that carry ``message``:
        compact, chunked when large, each checked against ``kafka.max_message_bytes``.
        A streamed session's turn is compacted against the session's earlier turns, so
        call this once per message, in the order they are sent.
        Raises :class:`infra.kafka.MessageTooLarge` with a one-line reason,
        :class:`ExperimentMismatch` (a ``ValueError``) for a message of another experiment."""
        message = self.stamped(message)
        if isinstance(message, (ReadyTrajectory, SessionTurn, SessionEnd)) and not message.created_at:
            message = msgspec.structs.replace(message, created_at=time.time())
        if isinstance(message, SessionTurn):
            message = self._turns.compact(message)
        elif isinstance(message, SessionEnd):
            self._turns.end(message)
        return to_records(message, self.kafka.max_message_bytes)

    def stamped(self, message: TrajectoryMessage) -> TrajectoryMessage:
        """``message`` as this publisher sends it: naming :attr:`experiment` (left out for the
        default one, so default records keep their bytes). A chunked trajectory carries the
        stamp inside its reassembled value. :class:`ExperimentMismatch` if it names another experiment."""
        if not isinstance(message, (ReadyTrajectory, DiscardGroup, SessionTurn, SessionEnd)):
            return message
        check_channel(
            message,
            self.experiment,
            self.topic,
            fix="; publish it with experiment {named!r} (prm-pipeline publish --experiment {named})",
        )
        wanted = msgspec.UNSET if self.experiment == DEFAULT_EXPERIMENT else self.experiment
        if message.experiment_id is wanted or message.experiment_id == wanted:
            return message
        return msgspec.structs.replace(message, experiment_id=wanted)

    async def publish(self, message: TrajectoryMessage) -> None:
        """Queue one message (validated: it is a wire struct, so it was checked on construction)."""
        if self._producer is None:
            raise RuntimeError("TrajectoryPublisher is not started; use 'async with TrajectoryPublisher(...)'")
        await self._send(message, self.records(message))

    async def _send(self, message: TrajectoryMessage, records: list[Record]) -> None:
        assert self._producer is not None
        for value, headers in records:  # chunks in order, one key: one partition, in order
            if len(self._pending) >= self._max_pending:
                await self._wait(self._pending)
            fut = await self._producer.send(self.topic, value, key=message.group_id.encode(), headers=headers)
            self._pending.add(fut)
            fut.add_done_callback(self._on_delivered)
            self.records_sent += 1
        self.published[kind_of(message)] += 1

    async def publish_ready(self, trajectory: ReadyTrajectory) -> None:
        if not isinstance(trajectory, ReadyTrajectory):
            raise TypeError(f"publish_ready takes a ReadyTrajectory, got {type(trajectory).__name__}")
        await self.publish(trajectory)

    async def publish_turn(self, turn: SessionTurn) -> None:
        """Queue one turn of a streamed session (full form; compacted here against the
        session's earlier turns). Its session's records share the key ``group_id``, so
        they are read in the order they were queued."""
        if not isinstance(turn, SessionTurn):
            raise TypeError(f"publish_turn takes a SessionTurn, got {type(turn).__name__}")
        await self.publish(turn)

    async def end_session(self, end: SessionEnd) -> None:
        """Queue the end of a streamed session (after its last turn)."""
        if not isinstance(end, SessionEnd):
            raise TypeError(f"end_session takes a SessionEnd, got {type(end).__name__}")
        await self.publish(end)

    async def discard_group(self, group_id: str, reason: str = "") -> None:
        """Discard ``group_id`` of this publisher's experiment."""
        await self.publish(DiscardGroup(group_id=group_id, reason=reason, requested_at=time.time()))

    async def publish_many(self, messages: Iterable[TrajectoryMessage]) -> int:
        n = 0
        for message in messages:
            await self.publish(message)
            n += 1
        return n

    async def publish_jsonl(
        self, path: str | os.PathLike[str], *, on_progress: Callable[[str, int], None] | None = None
    ) -> dict[str, int]:
        """Publish every line of a JSONL file (full form; compacted here). Every line is
        validated and size-checked before the first send, so a bad line sends nothing.

        ``on_progress(phase, n)`` sees ``("validated", 1)`` per line, ``("publishing", total)``
        once, then ``("published", 1)`` per message queued (:mod:`prm_pipeline.progress`)."""
        if self._producer is None:
            raise RuntimeError("TrajectoryPublisher is not started; use 'async with TrajectoryPublisher(...)'")
        report = on_progress or (lambda _phase, _n: None)
        prepared = []
        for lineno, message in jsonl.load_lines(path):
            try:
                prepared.append((message, self.records(message)))
            except ExperimentMismatch as exc:  # FILE:LINE, as a malformed line says
                raise ExperimentMismatch(f"{os.fspath(path)}:{lineno}: {exc}") from None
            report("validated", 1)
        before = dict(self.published)
        report("publishing", len(prepared))
        for message, records in prepared:
            await self._send(message, records)
            report("published", 1)
        await self.flush()
        return {k: self.published[k] - before[k] for k in before}

    def _on_delivered(self, fut: asyncio.Future[Any]) -> None:
        self._pending.discard(fut)
        error = None if fut.cancelled() else fut.exception()
        if error is not None:
            self._errors.append(error)

    async def _wait(self, futures: set[asyncio.Future[Any]]) -> None:
        if futures:
            await asyncio.wait(list(futures))
        if self._errors:
            errors, self._errors = self._errors, []
            raise PublishError(f"{len(errors)} record(s) were not acknowledged: {errors[0]!r}") from errors[0]

    async def flush(self) -> None:
        """Wait until every queued record is acknowledged; raise :class:`PublishError` otherwise."""
        if self._producer is not None:
            await self._producer.flush()
        await self._wait(set(self._pending))
