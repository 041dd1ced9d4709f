"""Two workers with the same ``--worker-id`` (scoring_workers/heartbeat.py): the beat each
replaces in Redis is the other's, and each warns once; a worker alone never does."""

from __future__ import annotations

import logging

from scoring_workers import heartbeat
from scoring_workers.heartbeat import ALIVE_S, Heartbeat


class SharedBeats:
    """The heartbeat set of :class:`scoring_workers.ledger.LedgerView`: id -> last beat (ms)."""

    def __init__(self) -> None:
        self.beats: dict[str, int] = {}
        self.now_ms = 1_000_000

    async def beat(self, worker_id: str) -> tuple[int, int | None]:
        self.now_ms += 1
        previous, self.beats[worker_id] = self.beats.get(worker_id), self.now_ms
        return self.now_ms, previous


async def _step(beat: Heartbeat, ledger: SharedBeats) -> None:
    beat._last = float("-inf")  # due now: the test steps through beats, not seconds
    await beat.step(ledger, ready=True, stopping=False)


async def test_two_workers_with_one_id_each_warn_once(caplog) -> None:
    ledger = SharedBeats()
    first, second = Heartbeat("w-1"), Heartbeat("w-1")
    with caplog.at_level(logging.WARNING, logger=heartbeat.__name__):
        await _step(first, ledger)
        assert caplog.records == []  # nothing to replace: the first beat of the id
        await _step(second, ledger)  # replaces the first worker's live beat
        await _step(first, ledger)  # and the first worker finds the second's
        for _ in range(3):
            await _step(second, ledger)
            await _step(first, ledger)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert all("worker id 'w-1' is in use by another live worker" in w for w in warnings)


async def test_a_worker_alone_or_after_a_stale_beat_does_not_warn(caplog) -> None:
    ledger = SharedBeats()
    ledger.beats["w-1"] = ledger.now_ms - int(ALIVE_S * 1000) - 10  # a previous process, long silent
    alone = Heartbeat("w-1")
    with caplog.at_level(logging.WARNING, logger=heartbeat.__name__):
        for _ in range(5):
            await _step(alone, ledger)
    assert caplog.records == []
