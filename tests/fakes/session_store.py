"""An in-memory session store: :class:`~scoring_workers.session_store.SessionStore` without Redis.

It keeps what the store's script keeps — per session its turns in arrival order (a
repeated turn is a duplicate, the same id with other content a conflict, at most
``max_turns``), when its last record came, its session id and group size — and the idle
index, so that :class:`~scoring_workers.streams.SessionStreams`, the streamed records
and the sweeper can be unit-tested against it. tests/integration/test_session_store.py
and the streaming tests check the real one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from infra.schema import Interaction
from scoring_workers.prm.streamed import StreamedResult
from scoring_workers.session_store import Coords, ParkedSession, TurnOutcome


@dataclass
class FakeSession:
    session_id: str
    group_size: int
    last: float = field(default_factory=time.time)  # when its last record came (epoch seconds)
    turns: dict[str, Interaction] = field(default_factory=dict)  # arrival order
    results: list[StreamedResult] = field(default_factory=list)
    at: Coords | None = None  # the first turn's record


class FakeSessionStore:
    """``sessions``: (group, trajectory id) -> its parked session; ``index``: (group, trajectory
    id) -> when it goes idle (epoch seconds); ``dropped``: the sessions closed, in order."""

    def __init__(self, *, idle_s: float = 60.0, max_turns: int = 100) -> None:
        self.idle_s = idle_s
        self.max_turns = max_turns
        self.sessions: dict[tuple[str, str], FakeSession] = {}
        self.index: dict[tuple[str, str], float] = {}
        self.dropped: list[tuple[str, str]] = []

    async def park_turn(
        self,
        group: str,
        trajectory_id: str,
        turn: Interaction,
        *,
        session_id: str,
        group_size: int,
        at: Coords | None = None,
    ) -> tuple[TurnOutcome, int]:
        session = self.sessions.setdefault((group, trajectory_id), FakeSession(session_id, group_size))
        if (parked := session.turns.get(turn.interaction_id)) is not None:
            k = list(session.turns).index(turn.interaction_id) + 1
            return (TurnOutcome.DUPLICATE if parked == turn else TurnOutcome.CONFLICT), k
        if len(session.turns) >= self.max_turns:
            return TurnOutcome.FULL, len(session.turns)
        if not session.turns:
            session.at = at
        session.turns[turn.interaction_id] = turn
        session.last = time.time()
        self.index[(group, trajectory_id)] = session.last + self.idle_s
        return TurnOutcome.PARKED, len(session.turns)

    async def park_results(
        self, group: str, trajectory_id: str, interaction_id: str, child_id: str, results: Sequence[StreamedResult]
    ) -> None:
        if (session := self.sessions.get((group, trajectory_id))) is not None:
            session.results += results

    async def load(self, group: str, trajectory_id: str) -> ParkedSession:
        session = self.sessions.get((group, trajectory_id))
        if session is None:
            return ParkedSession()
        return ParkedSession(turns=list(session.turns.values()), results=list(session.results), at=session.at)

    async def first_record(self, group: str, trajectory_id: str) -> Coords | None:
        session = self.sessions.get((group, trajectory_id))
        return None if session is None else session.at

    async def drop(self, group: str, trajectory_id: str) -> None:
        self.sessions.pop((group, trajectory_id), None)
        self.index.pop((group, trajectory_id), None)
        self.dropped.append((group, trajectory_id))

    async def due(self, limit: int = 64) -> list[tuple[str, str]]:
        now = time.time()
        return [key for key, at in self.index.items() if at <= now][:limit]

    async def idle(self, group: str, trajectory_id: str) -> tuple[float, str, int] | None:
        session = self.sessions.get((group, trajectory_id))
        if session is None:
            return None
        return max(0.0, time.time() - session.last), session.session_id, session.group_size

    async def forget(self, group: str, trajectory_id: str) -> None:
        self.index.pop((group, trajectory_id), None)

    async def postpone(self, group: str, trajectory_id: str, idle_s: float) -> None:
        self.index[(group, trajectory_id)] = time.time() + self.idle_s - idle_s
