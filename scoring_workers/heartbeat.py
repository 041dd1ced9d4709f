"""A worker's heartbeat in Redis, for ``prm-pipeline status``.

Consumer-group membership is a poor liveness signal: a killed worker stays a member
until its session times out (and the embedded test broker never expires it), and a
member says nothing about which worker it is. So a ready worker beats every
:data:`HEARTBEAT_S` in the ledger's ``<prefix>:workers`` set
(:meth:`scoring_workers.ledger.LedgerView.beat`), leaves it when it stops
(:meth:`~scoring_workers.ledger.LedgerView.retire`), and ``status`` counts a worker
alive while its last beat is younger than :data:`ALIVE_S`.

Worker ids must be unique: two workers started with the same ``--worker-id`` would count
as one in ``status`` and sign each other's verdicts (``worker_id``). Each beat reads back
the beat it replaces; one that this worker did not write, younger than :data:`ALIVE_S`, is
another live worker's, and the worker logs a warning (once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from scoring_workers.telemetry import WorkerTelemetry

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
ALIVE_S = 3 * HEARTBEAT_S  # two missed beats are tolerated (a Redis blip, a long GC pause)


class Heartbeat:
    """Stepped by the worker's liveness loop (every second until the first beat, then as :meth:`wait_s`
    says); beats at most every :data:`HEARTBEAT_S`."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._last = float("-inf")
        self._retired = False
        self._beat_ms: int | None = None  # the last beat this worker wrote (epoch ms)
        self._warned = False

    def wait_s(self, *, ready: bool) -> float:
        """How long the liveness loop may sleep before its next step: a second until the
        first beat (readiness must be seen soon), then until the next beat is due (the
        liveness tick needs no more: ``/healthz`` allows ``LIVENESS_STALE_S``)."""
        if not ready or self._last == float("-inf"):
            return 1.0
        return max(0.05, HEARTBEAT_S - (time.monotonic() - self._last))

    async def step(self, ledger: Any | None, *, ready: bool, stopping: bool) -> None:
        """``ledger``: the :class:`~scoring_workers.ledger.LedgerView` (None before it is open)."""
        if ledger is None or self._retired:
            return
        try:
            if stopping:
                self._retired = True
                await ledger.retire(self.worker_id)
            elif ready and time.monotonic() - self._last >= HEARTBEAT_S:
                now_ms, previous = await ledger.beat(self.worker_id)
                self._last = time.monotonic()
                self._check_unique(now_ms, previous)
                self._beat_ms = now_ms
        except Exception as exc:  # noqa: BLE001 - Redis trouble: the record path retries and counts it
            log.debug("worker %s: heartbeat skipped: %s: %s", self.worker_id, type(exc).__name__, exc)

    def _check_unique(self, now_ms: int, previous_ms: int | None) -> None:
        """Warn (once) when the beat just replaced is a live one this worker did not write."""
        if (
            self._warned
            or previous_ms is None
            or previous_ms == self._beat_ms
            or now_ms - previous_ms >= ALIVE_S * 1000
        ):
            return
        self._warned = True
        log.warning(
            "worker id %r is in use by another live worker (it beat %.1f s ago): give each worker its own "
            "--worker-id, or status counts them as one and their verdicts name the same worker (a process of "
            "this id that was killed less than %g s ago looks the same)",
            self.worker_id,
            (now_ms - previous_ms) / 1000,
            ALIVE_S,
        )

    async def run(self, stop: asyncio.Event, telemetry: WorkerTelemetry, view: Callable[[], Any | None]) -> None:
        """The worker's liveness loop. Liveness = the event loop runs (not: Kafka and Redis
        answer); readiness ends at stop. A ready worker also beats in Redis and leaves at
        stop. ``view``: the ledger's :class:`~scoring_workers.ledger.LedgerView` once open."""
        while True:
            telemetry.tick()
            if stop.is_set():
                telemetry.ready = False
            await self.step(view(), ready=telemetry.ready, stopping=stop.is_set())
            if stop.is_set():
                await asyncio.sleep(1.0)
            else:  # wake at stop: leave the heartbeat set while the ledger is still open
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.wait_s(ready=telemetry.ready))
