"""The sweeper: rejects groups whose deadline passed, re-publishes orphaned decisions, answers idle sessions.

Every worker sweeps (in the background, every ``worker.sweep_interval_s``): it asks the
ledger's deadline index for the groups due (:meth:`~scoring_workers.ledger.GroupLedger.due_groups`)
and decides each one ``deadline`` (``missing_sessions``). A group decided already and not
finished is one whose publisher may have died between deciding and publishing: once the
re-publish grace has passed, its stored decision is published again (the trainer's dedupe
drops a repeated verdict). A group finished or gone leaves the index.

Each group is handled in isolation: a failure is logged and counted
(``prm_worker_sweep_failures_total``) and the sweep goes on with the next group; a group
that fails for a reason no retry fixes is looked at again only after
``worker.sweep_backoff_s``, so one broken group cannot flood the log.

Then it answers the groups of streamed sessions gone idle (no record for
``worker.session_idle_s``, :class:`~scoring_workers.session_store.SessionStore`'s index):
the member is parked ``failed`` (``session_idle``), which rejects its group at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from infra import reasons
from infra.config import PipelineConfig
from infra.retry import is_transient
from infra.schema import SessionResult
from scoring_workers.fleet import Experiment
from scoring_workers.ledger import DecideOutcome, DecisionKind, Ledger, ParkRequest
from scoring_workers.publishing import Publisher
from scoring_workers.streams import SessionStreams
from scoring_workers.telemetry import WorkerTelemetry

log = logging.getLogger(__name__)


class Sweeper:
    """One worker's sweeps. ``served(group)`` gives a scoped group's experiment and its settings;
    ``streams``: the open streamed sessions (None: the worker takes none)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        ledger: Ledger,
        publisher: Publisher,
        served: Callable[[str], tuple[str, Experiment]],
        telemetry: WorkerTelemetry,
        worker_id: str,
        streams: SessionStreams | None = None,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.publisher = publisher
        self._served = served
        self._telemetry = telemetry
        self.worker_id = worker_id
        self.streams = streams

    async def sweep(self) -> None:
        """The sweeper's round (overdue groups), then the streamed sessions gone idle."""
        await self._sweep_groups()
        if self.streams is not None:
            await self._sweep_sessions(self.streams)

    async def _sweep_groups(self) -> None:
        """Reject overdue groups and re-publish decisions whose publisher died."""
        try:
            due = await self.ledger.due_groups(linger_s=self.cfg.worker.sweep_interval_s / 2)
        except Exception as exc:  # noqa: BLE001 - Redis down: the next sweep tries again
            self._telemetry.sweep_failures.labels(type(exc).__name__).inc()
            log.warning("worker %s: sweep skipped: %s: %s", self.worker_id, type(exc).__name__, exc)
            return
        for group_id in due:
            try:
                await self._sweep_group(group_id)
            except Exception as exc:  # never let one group stop the others, or the sweeper die
                self._telemetry.sweep_failures.labels(type(exc).__name__).inc()
                if is_transient(exc):
                    log.warning(
                        "worker %s: sweep skipped for group %s: transient %s: %s",
                        self.worker_id,
                        group_id,
                        type(exc).__name__,
                        exc,
                    )
                    continue
                backoff_s = self.cfg.worker.sweep_backoff_s
                log.exception(
                    "worker %s: sweep failed for group %s; next look in %.0fs", self.worker_id, group_id, backoff_s
                )
                with contextlib.suppress(Exception):  # not every sweep: a broken group must not flood the log
                    await self.ledger.postpone(group_id, backoff_s)

    async def _sweep_group(self, group_id: str) -> None:
        _, experiment = self._served(group_id)
        grace_s = self.cfg.worker.republish_grace_s
        decision = await self.ledger.decide(
            group_id,
            DecisionKind.DEADLINE,
            worker_id=self.worker_id,
            scorers=experiment.scorers_blob,
            group_timeout_s=experiment.group_timeout_s,
            republish_grace_s=grace_s,
        )
        match decision.outcome:
            case DecideOutcome.DECIDED_NOW:
                await self.publisher.publish(decision)
            case DecideOutcome.ALREADY_DECIDED:
                if time.time() * 1000 - decision.decided_at_ms >= grace_s * 1000:
                    await self.publisher.publish(decision)  # its publisher died: re-publish
            case DecideOutcome.DONE | DecideOutcome.GONE:
                await self.ledger.forget(group_id)  # a stale index entry
            case DecideOutcome.NOT_DUE | DecideOutcome.INCOMPLETE:
                pass

    async def _sweep_sessions(self, streams: SessionStreams) -> None:
        """Answer the groups of streamed sessions idle past ``worker.session_idle_s``: the
        member is parked ``failed`` (``session_idle``), which rejects its group at once."""
        store = streams.store
        for group, trajectory_id in await store.due():
            seen = await store.idle(group, trajectory_id)
            if seen is None:  # closed (its member parked) or expired
                await store.forget(group, trajectory_id)
                continue
            idle_s, session_id, group_size = seen
            if idle_s < store.idle_s:  # a record came since it was indexed
                await store.postpone(group, trajectory_id, idle_s)
                continue
            _, experiment = self._served(group)
            result = SessionResult.failure(
                code=reasons.SESSION_IDLE,
                session_id=session_id or trajectory_id,
                trajectory_id=trajectory_id,
                detail=f"streamed session {session_id!r} received no record for {idle_s:.0f}s "
                f"(worker.session_idle_s={store.idle_s:g}) and never ended",
                scored_at=time.time(),
            )
            ((_, decision),) = await self.ledger.park_many(
                [
                    ParkRequest(
                        result, group, group_size, experiment.group_timeout_s, self.worker_id, experiment.scorers_blob
                    )
                ]
            )
            if decision is not None:
                await self.publisher.publish(decision)
            await streams.close(group, trajectory_id)
