"""What a worker does with the ledger's answers: one ``settle_*`` per ledger call.

Whoever decides a group publishes its verdict. A member the ledger already knows (parked
before, or of a group decided meanwhile) is acknowledged without being scored again, said
in a throttled log line; a group decided and not finished has its sweep brought forward
(its decider may have died before publishing); a finished one leaves the index. The
calls whose answers these are — parking a member, deciding a group, dead-lettering a
record (which rejects its group, ``invalid_member``) — are made here too, so a ``ready``
member and a streamed one (:mod:`~scoring_workers.streamed_records`) are parked and
settled alike.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from aiokafka.structs import ConsumerRecord

from infra.config import PipelineConfig
from infra.schema import NotConcatExport, compact_turns
from infra.throttle import LogThrottle
from scoring_workers.fleet import Experiment
from scoring_workers.jobs import EndJob, ReadyJob, TurnJob
from scoring_workers.ledger import DecideOutcome, Decision, DecisionKind, Ledger, ParkOutcome, ParkRequest, ProbeOutcome
from scoring_workers.publishing import Publisher
from scoring_workers.telemetry import WorkerTelemetry
from scoring_workers.tokens import MemberTokens

log = logging.getLogger(__name__)


class Settler:
    """One worker's ledger calls for its records and what it does with their answers.
    ``served(group)`` gives a scoped group's experiment and its settings (as the sweeper's)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        ledger: Ledger,
        publisher: Publisher,
        tokens: MemberTokens,
        served: Callable[[str], tuple[str, Experiment]],
        telemetry: WorkerTelemetry,
        worker_id: str,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.publisher = publisher
        self._tokens = tokens
        self._served = served
        self._telemetry = telemetry
        self.worker_id = worker_id
        self._duplicates_log = LogThrottle(log, burst=20, window_s=60.0)  # duplicates are normal, but say so

    async def park(
        self, job: ReadyJob | EndJob, group_size: int, experiment: Experiment, partition: int, offset: int
    ) -> None:
        """Park ``job.result``, then settle what the ledger answered."""
        assert job.result is not None
        if job.result.status == "failed":
            # Parking a failed member decides (rejects) the group: the members consumed
            # before it go first, so the verdict lists them with their stats.
            await job.wait_earlier()
        result = msgspec.structs.replace(job.result, consumed_at=job.consumed_at, parked_at=time.time())
        ((outcome, decision),) = await self.ledger.park_many(
            [
                ParkRequest(
                    result,
                    job.group,
                    group_size,
                    experiment.group_timeout_s,
                    self.worker_id,
                    experiment.scorers_blob,
                    partition,
                    offset,
                )
            ]
        )
        await self.settle_park(job, outcome, decision)

    async def dead_letter(
        self, record: ConsumerRecord, error: BaseException, attempt: int, *, group_id: str | None = None
    ) -> None:
        """Dead-letter ``record`` (:meth:`Publisher.dead_letter`), then reject the (scoped) group
        its key names (``invalid_member``) instead of letting it wait for its deadline."""
        letter = await self.publisher.dead_letter(record, error, attempt)
        if group_id is not None:
            reason = (
                f"invalid_member: record {record.topic}:{record.partition}@{record.offset} was dead-lettered "
                f"({letter.error_class}: {letter.error_message[:200]})"
            )
            await self.decide(group_id, DecisionKind.INVALID, discard_reason=reason)

    async def decide(self, group_id: str, kind: DecisionKind, *, discard_reason: str = "") -> None:
        """Decide the (scoped) group ``group_id``, then settle what the ledger answered."""
        _, experiment = self._served(group_id)
        decision = await self.ledger.decide(
            group_id,
            kind,
            worker_id=self.worker_id,
            scorers=experiment.scorers_blob,
            discard_reason=discard_reason,
            group_timeout_s=experiment.group_timeout_s,
            republish_grace_s=self.cfg.worker.republish_grace_s,
        )
        await self.settle_decision(decision)

    async def settle_probe(self, job: ReadyJob | EndJob, probe: ProbeOutcome) -> None:
        """A member the probe found known is acknowledged without scoring. Parked already (a
        redelivery): re-run the ``complete`` decision, in case the crash came between parking
        the last member and deciding. Its group decided and not finished: bring its sweep
        forward (its decider may have died before publishing)."""
        match probe:
            case ProbeOutcome.DUPLICATE:
                if self._tokens.inline and isinstance(job, ReadyJob):
                    with contextlib.suppress(NotConcatExport):  # the record in hand spares reading its tokens back
                        self._tokens.remember(
                            job.group, job.message.trajectory_id, compact_turns(job.message.interactions)
                        )
                await self.decide(job.group, DecisionKind.COMPLETE)
            case ProbeOutcome.DECIDED:
                await self.ledger.nudge(job.group, self.cfg.worker.republish_grace_s)
            case ProbeOutcome.DONE | ProbeOutcome.NEW:
                pass
        self.acknowledged(job, duplicate=probe is ProbeOutcome.DUPLICATE, at_park=False)

    async def settle_park(self, job: ReadyJob | EndJob, outcome: ParkOutcome, decision: Decision | None) -> None:
        """This park decided the group (it completed it, or failed): publish its verdict. A
        member of a group decided meanwhile nudges it (as :meth:`settle_probe`); one parked
        before, or of a finished group, is acknowledged."""
        if decision is not None:
            await self.publisher.publish(decision)
            return
        match outcome:
            case ParkOutcome.PARKED:
                return
            case ParkOutcome.DECIDED:
                await self.ledger.nudge(job.group, self.cfg.worker.republish_grace_s)
            case ParkOutcome.DUPLICATE | ParkOutcome.DONE:
                pass
        self.acknowledged(job, duplicate=outcome is ParkOutcome.DUPLICATE, at_park=True)

    async def settle_decision(self, decision: Decision) -> None:
        """This call decided the group: publish its verdict. Decided before and not finished:
        bring its sweep forward. Finished (or vanished): drop its index entry."""
        match decision.outcome:
            case DecideOutcome.DECIDED_NOW:
                await self.publisher.publish(decision)
            case DecideOutcome.ALREADY_DECIDED:
                await self.ledger.nudge(decision.group_id, self.cfg.worker.republish_grace_s)
            case DecideOutcome.DONE | DecideOutcome.GONE:
                await self.ledger.forget(decision.group_id)
            case DecideOutcome.NOT_DUE | DecideOutcome.INCOMPLETE:
                pass

    def acknowledged(self, job: ReadyJob | EndJob | TurnJob, *, duplicate: bool, at_park: bool) -> None:
        """``job`` is acknowledged without being scored (again): counted as deduplicated, and said (throttled)."""
        self._telemetry.deduplicated.inc()
        what = (
            "already scored (a redelivery or a re-published record)"
            if duplicate
            else "its group is already decided (a re-published or redriven record"
            + (", or decided while it was scored)" if at_park else ")")
        )
        self._duplicates_log.log(
            logging.INFO,
            "group=%s traj=%s: duplicate acknowledged%s, %s",
            job.message.group_id,
            job.message.trajectory_id,
            " at park" if at_park else "",
            what,
        )
