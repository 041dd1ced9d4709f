"""An in-memory group ledger: the :class:`~scoring_workers.ledger.Ledger` protocol without Redis.

It keeps the transitions of the ledger's script (``scoring_workers/ledger_scripts.py``)
— a park that completes its group, or a failed one, decides it in the same step; a member
parked twice stands as first parked; a decided group is never decided again; a finished
group is remembered as done — so the worker's decisions can be unit-tested against it.
The real-Redis tests (tests/integration/test_ledger.py and the worker's integration tests)
check the script itself. It records every call, and raises what ``fail`` holds for a call
(an injected outage) before doing anything.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from scoring_workers.ledger import (
    DecideOutcome,
    Decision,
    DecisionKind,
    GroupState,
    ParkedMember,
    ParkOutcome,
    ParkRequest,
    ProbeOutcome,
)


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class FakeGroup:
    """One group as the script keeps it: its state fields and its parked members."""

    group_size: int
    deadline: int
    first_seen: int = field(default_factory=_now_ms)
    members: dict[str, ParkedMember] = field(default_factory=dict)
    size_mismatch: int | None = None
    decision: DecisionKind | None = None
    discard_reason: str = ""
    decided_at: int = 0
    decided_by: str = ""
    scorers: bytes = b""

    def state(self) -> GroupState:
        return GroupState(
            status="open" if self.decision is None else "decided",
            group_size=self.group_size,
            first_seen=self.first_seen,
            deadline=self.deadline,
            size_mismatch=self.size_mismatch,
            decision=self.decision,
            discard_reason=self.discard_reason,
            decided_at=self.decided_at,
            decided_by=self.decided_by,
            scorers=self.scorers,
        )


class FakeLedger:
    """The ledger in memory. ``index``: the deadline index (group -> epoch ms when a sweeper
    looks at it); ``done``: finished groups; ``calls``: ``(method, group)`` in call order."""

    def __init__(self) -> None:
        self.groups: dict[str, FakeGroup] = {}
        self.done: set[str] = set()
        self.index: dict[str, int] = {}
        self.expected: list[tuple[str, str]] = []
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[str, list[BaseException]] = {}  # method -> errors its next calls raise, in order

    def _call(self, method: str, group_id: str) -> None:
        self.calls.append((method, group_id))
        if errors := self.fail.get(method):
            raise errors.pop(0)

    def called(self, method: str) -> list[str]:
        """The groups ``method`` was called for, in order."""
        return [g for m, g in self.calls if m == method]

    # ---------------------------------------------------------------- the protocol
    async def probe_many(self, items: Sequence[tuple[str, str]]) -> list[ProbeOutcome]:
        out: list[ProbeOutcome] = []
        for group_id, trajectory_id in items:
            self._call("probe", group_id)
            group = self.groups.get(group_id)
            if group is None:
                out.append(ProbeOutcome.DONE if group_id in self.done else ProbeOutcome.NEW)
            elif group.decision is not None:
                out.append(ProbeOutcome.DECIDED)
            else:
                out.append(ProbeOutcome.DUPLICATE if trajectory_id in group.members else ProbeOutcome.NEW)
        return out

    def expect(self, items: Sequence[tuple[str, str]]) -> None:
        self.expected += items

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[tuple[ParkOutcome, Decision | None]]:
        return [self._park(r) for r in requests]

    def _park(self, r: ParkRequest) -> tuple[ParkOutcome, Decision | None]:
        self._call("park", r.group_id)
        now = _now_ms()
        group = self.groups.get(r.group_id)
        if group is not None and group.decision is not None:
            return ParkOutcome.DECIDED, None
        if group is None:
            if r.group_id in self.done:
                return ParkOutcome.DONE, None
            group = self.groups[r.group_id] = FakeGroup(r.group_size, now + int(r.group_timeout_s * 1000))
            self.index[r.group_id] = group.deadline
        tid = r.result.trajectory_id
        failed = r.result.status == "failed"
        outcome, kind = ParkOutcome.PARKED, DecisionKind.FAILED if failed else DecisionKind.COMPLETE
        if tid in group.members:
            outcome, kind = ParkOutcome.DUPLICATE, DecisionKind.COMPLETE  # the member parked first stands
        else:
            group.members[tid] = ParkedMember(msgspec.structs.replace(r.result, turns=[]), r.partition, r.offset)
            if r.group_size != group.group_size:
                group.size_mismatch = r.group_size
        if kind is DecisionKind.FAILED or group.size_mismatch is not None or len(group.members) >= group.group_size:
            self._record(group, kind, now, r.worker_id, r.scorers, "")
            return outcome, self._decision(r.group_id, DecideOutcome.DECIDED_NOW, group)
        return outcome, None

    async def decide(
        self,
        group_id: str,
        kind: DecisionKind,
        *,
        worker_id: str,
        scorers: bytes,
        discard_reason: str = "",
        group_timeout_s: float,
        republish_grace_s: float,
    ) -> Decision:
        self._call(f"decide:{kind}", group_id)
        now = _now_ms()
        group = self.groups.get(group_id)
        if group is None and group_id in self.done:
            return self._decision(group_id, DecideOutcome.DONE, None)
        if group is not None and group.decision is not None:
            return self._decision(group_id, DecideOutcome.ALREADY_DECIDED, group)
        if kind in (DecisionKind.DEADLINE, DecisionKind.COMPLETE) and group is None:
            return self._decision(group_id, DecideOutcome.GONE, None)
        if kind is DecisionKind.DEADLINE and group is not None and now < group.deadline:
            return self._decision(group_id, DecideOutcome.NOT_DUE, None)
        if (
            kind is DecisionKind.COMPLETE
            and group is not None
            and group.size_mismatch is None
            and len(group.members) < group.group_size
        ):
            return self._decision(group_id, DecideOutcome.INCOMPLETE, None)
        if group is None:
            group = self.groups[group_id] = FakeGroup(0, now)
        self._record(group, kind, now, worker_id, scorers, discard_reason)
        self.index[group_id] = now + int(republish_grace_s * 1000)  # re-published after the grace unless finished
        return self._decision(group_id, DecideOutcome.DECIDED_NOW, group)

    def finish_soon(self, group_id: str) -> None:
        self.calls.append(("finish", group_id))
        self.groups.pop(group_id, None)
        self.index.pop(group_id, None)
        self.done.add(group_id)

    async def nudge(self, group_id: str, republish_grace_s: float) -> None:
        self._call("nudge", group_id)
        if group_id in self.index:  # never later, never re-adding
            self.index[group_id] = min(self.index[group_id], _now_ms() + int(republish_grace_s * 1000))

    async def postpone(self, group_id: str, delay_s: float) -> None:
        self._call("postpone", group_id)
        if group_id in self.index:
            self.index[group_id] = _now_ms() + int(delay_s * 1000)

    async def forget(self, group_id: str) -> None:
        self._call("forget", group_id)
        self.index.pop(group_id, None)

    async def due_groups(self, limit: int = 64, *, linger_s: float = 0.0) -> list[str]:
        self._call("due", "")
        now = _now_ms()
        return sorted((g for g, at in self.index.items() if at <= now), key=self.index.__getitem__)[:limit]

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _record(group: FakeGroup, kind: DecisionKind, now: int, worker_id: str, scorers: bytes, reason: str) -> None:
        group.decision, group.decided_at, group.decided_by = kind, now, worker_id
        group.scorers, group.discard_reason = scorers, reason

    @staticmethod
    def _decision(group_id: str, outcome: DecideOutcome, group: FakeGroup | None) -> Decision:
        if group is None or outcome not in (DecideOutcome.DECIDED_NOW, DecideOutcome.ALREADY_DECIDED):
            return Decision(outcome, group_id, GroupState(), [])
        return Decision(outcome, group_id, group.state(), list(group.members.values()))
