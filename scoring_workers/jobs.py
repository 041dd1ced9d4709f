"""What the worker does with a fetched record, decided once when its poll is decoded.

One small type per kind of record, so that the worker switches on the type (``match``)
and each handler gets the message it handles, typed: a :class:`ReadyJob` (a
``ReadyTrajectory``, a chunked one with its last chunk), a :class:`DiscardJob` (a
``DiscardGroup``) or an :class:`InvalidJob` (a record that did not decode or broke a
schema rule: a dead letter); a streamed session's records are a :class:`TurnJob` (a
``SessionTurn``: parked, its parent judged) and an :class:`EndJob` (a ``SessionEnd``: the
member, scored and parked like a ready one).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from aiokafka.structs import ConsumerRecord, TopicPartition

from infra.experiments import scoped_group
from infra.schema import DiscardGroup, ReadyTrajectory, SchemaError, SessionEnd, SessionResult, SessionTurn
from scoring_workers.fleet import Experiment
from scoring_workers.ledger import ProbeOutcome


class Routed(msgspec.Struct, frozen=True):
    """Where a record belongs: its experiment (None: not served here) and its scoped group key."""

    experiment_id: str
    experiment: Experiment | None
    scoped: str | None  # scoped_group(experiment_id, group_id); None when the record names no group


@dataclass(slots=True, eq=False, kw_only=True)
class _Job:
    """What every kind of job carries.

    ``extra``: offsets of the other chunks of a chunked trajectory (same partition),
    finished with it; ``earlier``: the in-flight records of its group consumed before it,
    which it waits for before it may decide the group (:class:`InFlightGroups`);
    ``attempt``: the current attempt."""

    kind: ClassVar[str]  # the ``kind`` label of the worker's record counters
    record: ConsumerRecord
    route: Routed
    extra: list[int] = field(default_factory=list)
    consumed_at: float = 0.0
    earlier: tuple[asyncio.Future[Any], ...] = ()
    attempt: int = 0

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.record.topic, self.record.partition)

    async def wait_earlier(self) -> None:
        """Wait for ``earlier``: their outcomes, success or not, are in the ledger or retried."""
        if pending := [t for t in self.earlier if not t.done()]:
            await asyncio.wait(pending)


@dataclass(slots=True, eq=False, kw_only=True)
class ReadyJob(_Job):
    """A member to score and park. ``probe``: what the ledger said before scoring (None: ask
    when it starts); ``result``: its scoring result once scored (a retry parks it without
    scoring again); ``behind_discard``: a discard of its group was in flight when it started
    (it waits for that decision before anything else)."""

    kind: ClassVar[str] = "ready"
    message: ReadyTrajectory
    probe: ProbeOutcome | None = None
    result: SessionResult | None = None
    behind_discard: bool = False

    @property
    def group(self) -> str:
        """Its scoped group (:func:`infra.experiments.scoped_group`)."""
        return scoped_group(self.route.experiment_id, self.message.group_id)


@dataclass(slots=True, eq=False, kw_only=True)
class DiscardJob(_Job):
    """A ``DiscardGroup``: it decides its group once the members consumed before it have parked."""

    kind: ClassVar[str] = "discard"
    message: DiscardGroup

    @property
    def group(self) -> str:
        """Its scoped group (:func:`infra.experiments.scoped_group`)."""
        return scoped_group(self.route.experiment_id, self.message.group_id)


@dataclass(slots=True, eq=False, kw_only=True)
class InvalidJob(_Job):
    """A record that did not decode or broke a schema rule: dead-lettered, its group (if its key names one) rejected."""

    kind: ClassVar[str] = "invalid"
    error: SchemaError


@dataclass(slots=True, eq=False, kw_only=True)
class TurnJob(_Job):
    """One turn of a streamed session: parked with its session, and its parent's streamable
    scorers started now that the parent's next state is here. It waits for the records of
    its session (and its group's discards) consumed before it: a session's turns are parked
    in their order."""

    kind: ClassVar[str] = "turn"
    message: SessionTurn

    @property
    def group(self) -> str:
        return scoped_group(self.route.experiment_id, self.message.group_id)


@dataclass(slots=True, eq=False, kw_only=True)
class EndJob(_Job):
    """The end of a streamed session: the member, rebuilt from its parked turns, scored with
    what is left and parked like a :class:`ReadyJob` (``probe``, ``result`` as there)."""

    kind: ClassVar[str] = "end"
    message: SessionEnd
    probe: ProbeOutcome | None = None
    result: SessionResult | None = None

    @property
    def group(self) -> str:
        return scoped_group(self.route.experiment_id, self.message.group_id)


Job = ReadyJob | DiscardJob | InvalidJob | TurnJob | EndJob
Message = ReadyTrajectory | DiscardGroup | SessionTurn | SessionEnd


def job_of(
    record: ConsumerRecord, message: Message | SchemaError, route: Routed, extra: list[int], consumed_at: float
) -> Job:
    """The typed job of a decoded record."""
    match message:
        case ReadyTrajectory():
            return ReadyJob(record=record, route=route, extra=extra, consumed_at=consumed_at, message=message)
        case DiscardGroup():
            return DiscardJob(record=record, route=route, extra=extra, consumed_at=consumed_at, message=message)
        case SessionTurn():
            return TurnJob(record=record, route=route, extra=extra, consumed_at=consumed_at, message=message)
        case SessionEnd():
            return EndJob(record=record, route=route, extra=extra, consumed_at=consumed_at, message=message)
        case SchemaError():
            return InvalidJob(record=record, route=route, extra=extra, consumed_at=consumed_at, error=message)


class InFlightGroups:
    """The in-flight records of each group, in consumption order: the one mechanism by which
    a record waits for the records of its group consumed before it (``job.earlier``).

    A discard or an invalid record waits for them at once (each decides its group, and the
    verdict must list those members), a member behind a discard at once too (the discard
    may decide its group: the member must see that decision), any other member only before
    it parks a failure (which rejects the group). A streamed session's turn or end waits
    only for the earlier records of its own session and its group's discards: a session's
    records are handled in their order, and a turn is never held up by another member's
    scoring. Waiting only on earlier records, none can wait for itself."""

    def __init__(self) -> None:
        # scoped group -> task -> True for a discard, the trajectory id of a turn or end, else None
        self._groups: dict[str, dict[asyncio.Task[None], bool | str | None]] = {}

    def start(self, job: Job, run: Callable[[Job], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        """Set ``job.earlier``, then run ``run(job)`` in a task counted in its group until done."""
        scoped = job.route.scoped or ""
        group = self._groups.get(scoped, {})
        if isinstance(job, (TurnJob, EndJob)):
            session = job.message.trajectory_id
            job.earlier = tuple(t for t, tag in group.items() if tag is True or tag == session)
        else:
            job.earlier = tuple(group)
        if isinstance(job, ReadyJob) and any(tag is True for tag in group.values()):
            job.behind_discard, job.probe = True, None  # its probe is stale: the discard ahead may decide the group
        task = asyncio.create_task(run(job))
        if not isinstance(job, InvalidJob):  # an invalid record names no group, or waits as it may
            self._groups.setdefault(scoped, {})[task] = (
                True
                if isinstance(job, DiscardJob)
                else job.message.trajectory_id
                if isinstance(job, (TurnJob, EndJob))
                else None
            )
            task.add_done_callback(functools.partial(self._left, scoped))
        return task

    def _left(self, scoped: str, task: asyncio.Task[None]) -> None:
        group = self._groups.get(scoped)
        if group is not None:
            group.pop(task, None)
            if not group:
                del self._groups[scoped]
