"""The sweeper's answer to streamed sessions gone idle, against an in-memory ledger and session store.

(Its sweep of overdue groups is in tests/unit/test_worker.py, with the worker's other decisions.)
"""

from __future__ import annotations

import time

from infra import reasons
from tests.unit.test_streamed_records import _session, _streaming
from tests.unit.test_worker import _poll


async def test_an_idle_session_rejects_its_group_and_a_session_heard_from_since_is_looked_at_later() -> None:
    worker, ledger, producer, _, store, _ = _streaming()
    store.idle_s = 60.0
    idle_turns, _ = _session("g-idle", "a", size=2)
    live_turns, _ = _session("g-live", "b", size=2)
    await _poll(worker, [idle_turns[0], live_turns[0]])
    store.sessions[("g-idle", "a")].last -= 61  # nothing since a minute
    store.index = dict.fromkeys(store.index, time.time() - 1)  # both due per the index
    store.index[("g-closed", "c")] = time.time() - 1  # a stale entry: its session was closed

    await worker.sweeper.sweep()

    (verdict,) = producer.verdicts()
    assert (verdict.group_id, verdict.status) == ("g-idle", "rejected")
    (member,) = verdict.sessions
    assert (member.trajectory_id, member.failure_code) == ("a", reasons.SESSION_IDLE)
    assert store.dropped == [("g-idle", "a")]
    assert store.index[("g-live", "b")] > time.time() + 50  # postponed to when it goes idle
    assert ("g-closed", "c") not in store.index
    assert ledger.called("park") == ["g-idle"]
