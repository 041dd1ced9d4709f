"""Streamed sessions in a worker: park each turn, judge its parent now, hand the session over at its end.

The worker's record path stays one path: a ``turn`` record is a :class:`~scoring_workers.jobs.TurnJob`
and an ``end`` record an :class:`~scoring_workers.jobs.EndJob`, handled by the worker like
any other job. This module holds what they need between records:

* :meth:`SessionStreams.add_turn` parks the turn in Redis (:class:`~scoring_workers.session_store.SessionStore`;
  acknowledged only once parked), adds it to the session's in-memory
  :class:`~scoring_workers.open_sessions.OpenSession` and starts the runner's streamable
  scorers on its parent in the background (:meth:`PRMRunner.score_turn
  <scoring_workers.prm.runner.PRMRunner.score_turn>`): the turn's offset does not wait for the judge;
  the results are parked with the session when they come.
* :meth:`SessionStreams.ended` waits for the session's judge calls still running here,
  rebuilds the ``ready`` form (:func:`infra.schema.streamed_trajectory`) and returns it
  with the streamed results (:class:`~scoring_workers.prm.streamed.Reuse`), which the
  worker scores and parks exactly as a ``ready`` member, at the coordinates of the
  session's first ``turn`` record (:meth:`SessionStreams.member_coords`): any worker, and
  any verdict reader, can read the session back from there (:mod:`infra.readback`).

A worker that did not see the session's earlier turns (a takeover after a crash or a
rebalance) loads them, and the results parked so far, from Redis; a judge call that was
running on the dead worker is simply made again at the end. Memory: at most
``max_open`` sessions are kept here (least recently used first out; a session let go is
loaded again from Redis when its next record comes), each with its compact turns and its
messages frozen once for the scorers (read-only views, kept across its turns).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from infra.schema import Interaction, InvalidMessage, ReadyTrajectory, SessionEnd, SessionTurn, streamed_trajectory
from scoring_workers.ledger import STREAMED_PARTITION
from scoring_workers.open_sessions import OpenSession
from scoring_workers.prm import ScoringRunner
from scoring_workers.prm.streamed import Reuse, StreamedResult
from scoring_workers.session_store import Coords, SessionStore, TurnOutcome

__all__ = ["SessionStreams", "DEFAULT_MAX_OPEN", "Judged"]

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN = 10_000
"""Open sessions a worker keeps in memory (each: its compact turns and a few token contexts)."""

Judged = Callable[[str, SessionTurn, Interaction, int, list[StreamedResult]], Awaitable[None]]
"""Told of each turn judged while its session streams, for its first next state only:
(scoped group, the child's record, the judged turn in full, its number in the session,
the results) — the online samples (:mod:`scoring_workers.turn_samples`)."""


@dataclass(slots=True, eq=False)
class _Open:
    session: OpenSession
    results: list[StreamedResult] = field(default_factory=list)
    judged: set[tuple[str, str]] = field(default_factory=set)  # (turn, child) pairs judged or being judged
    running: set[asyncio.Task[None]] = field(default_factory=set)
    frozen: dict[str, Any] = field(default_factory=dict)  # the runner's message cache, kept across turns
    numbers: dict[str, int] = field(default_factory=dict)  # turn id -> 1, 2, ... in arrival order
    at: Coords | None = None  # the first turn's record, once known


class SessionStreams:
    """The open streamed sessions of one worker process."""

    def __init__(
        self, store: SessionStore, *, max_open: int = DEFAULT_MAX_OPEN, on_judged: Judged | None = None
    ) -> None:
        self.store = store
        self.max_open = max_open
        self.on_judged = on_judged
        self._open: OrderedDict[tuple[str, str], _Open] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    async def _get(self, group: str, trajectory_id: str, session_id: str) -> _Open:
        key = (group, trajectory_id)
        state = self._open.get(key)
        if state is not None:
            self._open.move_to_end(key)
            return state
        parked = await self.store.load(group, trajectory_id)
        state = self._open.get(key)  # loaded meanwhile by another record of the session
        if state is None:
            try:
                session = OpenSession.of(session_id, parked.turns)
            except InvalidMessage:  # cannot happen for turns this code parked; start over rather than wedge
                log.exception("session %s of group %s: parked turns do not form a session", trajectory_id, group)
                session = OpenSession(session_id)
            state = _Open(
                session,
                list(parked.results),
                set(parked.judged),
                numbers={t.interaction_id: k for k, t in enumerate(parked.turns, 1)},
                at=parked.at,
            )
            self._open[key] = state
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)  # its judge tasks run on; their results are parked
        return state

    async def add_turn(self, group: str, turn: SessionTurn, runner: ScoringRunner | None, *, at: Coords) -> TurnOutcome:
        """Park ``turn`` (its record at ``at``) and start judging its parent. ``DUPLICATE``:
        parked before, nothing to do. Raises :class:`InvalidMessage` for a turn that does not continue its session
        (the worker dead-letters it; its group is rejected) or one over
        ``worker.session_max_turns``."""
        state = await self._get(group, turn.trajectory_id, turn.session_id)
        it = turn.interaction
        if it.interaction_id in state.session:
            same = state.session.compact[it.interaction_id] == it
            if not same:
                raise InvalidMessage(
                    f"session {turn.session_id!r}: turn id {it.interaction_id!r} arrived again with other content"
                )
            return TurnOutcome.DUPLICATE
        full = state.session.add(it)  # InvalidMessage: not the session's next turn; nothing kept
        try:
            outcome, number = await self.store.park_turn(
                group, turn.trajectory_id, it, session_id=turn.session_id, group_size=turn.group_size, at=at
            )
        except BaseException:
            # Not durable: forget the session here, so the retry (or the next record) reloads
            # what Redis really holds instead of taking this turn for parked.
            self._open.pop((group, turn.trajectory_id), None)
            raise
        if outcome in (TurnOutcome.CONFLICT, TurnOutcome.FULL):
            self._open.pop((group, turn.trajectory_id), None)  # holds a turn Redis refused
        if outcome is TurnOutcome.CONFLICT:
            raise InvalidMessage(
                f"session {turn.session_id!r}: turn id {it.interaction_id!r} was parked before with other content"
            )
        if outcome is TurnOutcome.FULL:
            raise InvalidMessage(
                f"session {turn.session_id!r}: more than {self.store.max_turns} turns (worker.session_max_turns)"
            )
        state.numbers[it.interaction_id] = number
        if outcome is TurnOutcome.PARKED and number == 1:
            state.at = at  # as the store keeps it: a later copy of the first turn does not move it
        if it.parent_id is not None and runner is not None and runner.streams:
            self._judge(group, turn, state, it.parent_id, full, runner)
        return outcome

    def _judge(
        self, group: str, turn: SessionTurn, state: _Open, parent_id: str, child: Interaction, runner: ScoringRunner
    ) -> None:
        pair = (parent_id, child.interaction_id)
        if pair in state.judged:
            return
        first = not any(p == parent_id for p, _ in state.judged)
        state.judged.add(pair)
        parent = state.session.full(parent_id)

        async def judge() -> None:
            results = await runner.score_turn(
                parent, child, {"session_id": turn.session_id, "trajectory_id": turn.trajectory_id}, state.frozen
            )
            state.results += results
            await self.store.park_results(group, turn.trajectory_id, parent_id, child.interaction_id, results)
            if self.on_judged is not None and first:
                await self.on_judged(group, turn, parent, state.numbers.get(parent_id, 0), results)

        task = asyncio.create_task(judge())
        state.running.add(task)

        def done(task: asyncio.Task[None]) -> None:
            state.running.discard(task)
            if not task.cancelled() and (exc := task.exception()) is not None:
                # not parked: the end scores the turn itself (an outage here costs time, not results)
                state.judged.discard(pair)
                log.warning(
                    "session %s: streamed judging of turn %s failed (%s: %s); it is scored at the end",
                    turn.trajectory_id,
                    parent_id,
                    type(exc).__name__,
                    exc,
                )

        task.add_done_callback(done)

    async def ended(self, group: str, end: SessionEnd) -> tuple[ReadyTrajectory, Reuse]:
        """The ready form of the ended session and its streamed results, once the judge calls
        still running here are done. Raises :class:`InvalidMessage` when the turns and the
        end do not form a session."""
        state = await self._get(group, end.trajectory_id, end.session_id)
        if state.running:
            await asyncio.wait(list(state.running))
        if not state.session.compact:
            raise InvalidMessage(f"session {end.session_id!r} ended without a turn")
        traj = streamed_trajectory(list(state.session.compact.values()), end)
        return traj, Reuse(state.results, state.frozen)

    async def member_coords(self, group: str, trajectory_id: str) -> Coords:
        """Where the ended session's member is parked: its first ``turn`` record, from which
        :mod:`infra.readback` reads the session back; ``(STREAMED_PARTITION, -1)`` for a session
        whose first turn was parked without its coordinates (its turns then come only from the
        memory of the worker that scored its end)."""
        state = self._open.get((group, trajectory_id))
        at = state.at if state is not None else await self.store.first_record(group, trajectory_id)
        return at if at is not None else (STREAMED_PARTITION, -1)

    def last_turns(self, group: str, trajectory_id: str) -> list[tuple[Interaction, int]]:
        """The leaves of a session held here (full form, with their numbers): its last turns."""
        state = self._open.get((group, trajectory_id))
        if state is None:
            return []
        parents = {t.parent_id for t in state.session.compact.values()}
        return [
            (state.session.full(iid), state.numbers.get(iid, 0)) for iid in state.session.compact if iid not in parents
        ]

    async def close(self, group: str, trajectory_id: str) -> None:
        """The session's member is parked: forget it here and in Redis."""
        state = self._open.pop((group, trajectory_id), None)
        if state is not None:
            for task in state.running:
                task.cancel()
        await self.store.drop(group, trajectory_id)

    def drop(self) -> None:
        """Forget every session held here (partitions revoked: their next owner loads them from Redis)."""
        self._open.clear()

    async def aclose(self) -> None:
        tasks = [t for s in self._open.values() for t in s.running]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        self._open.clear()
