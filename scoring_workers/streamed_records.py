"""A streamed session's records in the worker: each ``turn`` parked with its session, the ``end`` scored and parked.

The worker's one record path switches on a job's kind and hands a ``turn`` record
(:class:`~scoring_workers.jobs.TurnJob`) and an ``end`` record
(:class:`~scoring_workers.jobs.EndJob`) here. Each asks the ledger first whether its
member is known: a turn of a member parked already, or of a decided group, is
acknowledged as a duplicate; an end is settled like a ``ready`` member found known.
Between records the session lives in :class:`~scoring_workers.streams.SessionStreams`
(Redis and memory); the member its end completes is scored with its streamed results
reused and parked exactly as a ``ready`` member, through the same
:class:`~scoring_workers.settling.Settler`. A record that does not continue its session
is dead-lettered and rejects its group. A session that goes idle is the sweeper's
(:mod:`~scoring_workers.sweeper`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from infra.config import PipelineConfig
from infra.schema import InvalidMessage, ReadyTrajectory, SessionResult
from scoring_workers.fleet import Experiment
from scoring_workers.jobs import EndJob, TurnJob
from scoring_workers.ledger import Ledger, ProbeOutcome
from scoring_workers.prm.streamed import Reuse
from scoring_workers.session_store import TurnOutcome
from scoring_workers.settling import Settler
from scoring_workers.streams import SessionStreams
from scoring_workers.tokens import MemberTokens
from scoring_workers.turn_samples import TurnSamples

__all__ = ["StreamedRecords", "Score"]

Score = Callable[[ReadyTrajectory, Experiment, Reuse], Awaitable[SessionResult]]
"""Scores a member with its experiment's runner, the given streamed results reused (the worker's)."""


class StreamedRecords:
    """One worker's handling of ``turn`` and ``end`` records. ``samples``: the online turn
    samples (``worker.turn_samples``; None: off)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        ledger: Ledger,
        streams: SessionStreams,
        settler: Settler,
        score: Score,
        tokens: MemberTokens,
        samples: TurnSamples | None = None,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.streams = streams
        self.settler = settler
        self._score = score
        self._tokens = tokens
        self._samples = samples

    async def handle_turn(self, job: TurnJob, experiment: Experiment) -> None:
        """Park a streamed turn and start judging its parent; a turn of a member already parked,
        or of a decided group, is acknowledged as a duplicate. One that does not continue its
        session is dead-lettered and rejects its group."""
        turn, group = job.message, job.group
        (probe,) = await self.ledger.probe_many([(group, turn.trajectory_id)])
        if probe is not ProbeOutcome.NEW:
            if probe is ProbeOutcome.DECIDED:
                await self.ledger.nudge(group, self.cfg.worker.republish_grace_s)
            self.settler.acknowledged(job, duplicate=probe is ProbeOutcome.DUPLICATE, at_park=False)
            return
        try:
            outcome = await self.streams.add_turn(
                group, turn, experiment.runner, at=(job.record.partition, job.record.offset)
            )
        except InvalidMessage as exc:
            await self.settler.dead_letter(job.record, exc, job.attempt, group_id=group)
            return
        if outcome is TurnOutcome.DUPLICATE:
            self.settler.acknowledged(job, duplicate=True, at_park=False)

    async def handle_end(self, job: EndJob, experiment: Experiment) -> None:
        """Score a streamed session's member once it ends — its streamed turn results reused,
        only the rest run — and park it exactly as a ``ready`` member."""
        end, group = job.message, job.group
        if job.probe is None:
            (job.probe,) = await self.ledger.probe_many([(group, end.trajectory_id)])
        if job.probe is not ProbeOutcome.NEW:
            await self.settler.settle_probe(job, job.probe)
            if job.probe is ProbeOutcome.DUPLICATE:  # parked before a crash: the session is done
                await self.streams.close(group, end.trajectory_id)
            return
        if job.result is None:
            try:
                traj, reuse = await self.streams.ended(group, end)
            except InvalidMessage as exc:
                await self.settler.dead_letter(job.record, exc, job.attempt, group_id=group)
                await self.streams.close(group, end.trajectory_id)
                return
            job.result = await self._score(traj, experiment, reuse)
            if self._samples is not None:  # its turns went out as online samples: online trainers have them
                job.result = msgspec.structs.replace(job.result, online_samples=True)
            self._tokens.remember(group, end.trajectory_id, job.result.turns)
        # parked at its first turn's record: any worker can read the session back from there
        coords = await self.streams.member_coords(group, end.trajectory_id)
        await self.settler.park(job, end.group_size, experiment, *coords)
        if self._samples is not None:
            await self._samples.ended(group, end, self.streams.last_turns(group, end.trajectory_id))
        await self.streams.close(group, end.trajectory_id)
