"""The bookkeeping of one audit, independent of Kafka: :class:`Auditor`, :class:`AuditReport`.

The :class:`Auditor` decodes records, matches verdict sessions to trajectories by
``trajectory_id``, re-scores each referenced trajectory once with bounded
concurrency (:func:`~prm_pipeline.audit.rescoring.rescore`) and keeps only the
comparisons; :meth:`Auditor.finish` turns them into an :class:`AuditReport`. It is
fed records by :func:`~prm_pipeline.audit.run.audit`, but takes plain bytes and
headers, so it runs without a broker.

Experiments (docs/fleet.md): two experiments may use the same group and trajectory
ids, so groups are kept by their scoped id (:func:`infra.experiments.scoped_group`) and
a verdict member is matched only with a trajectory of the verdict's own experiment. An
auditor for one experiment (``experiment=``, what ``audit --experiment`` builds) counts
and skips records that name another (``other_experiment_verdicts``,
``other_experiment_trajectories``).

Streamed sessions (``turn`` records, then an ``end``; docs/wire.md) are decoded and
counted (``streamed_turn_records``, ``streamed_end_records``), not re-scored: the audit
re-scores ``ready`` trajectories (chunked ones reassembled) only. A verdict member whose
trajectory was streamed is reported ``not_rescorable`` with a note saying so (not
``missing_trajectory``: its records are on the topic), and the session counts as a
trajectory seen in its group.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from infra.chunks import ChunkAssembler, reassembled
from infra.experiments import DEFAULT_EXPERIMENT, scoped_group, split_scoped
from infra.schema import (
    ALL_KINDS,
    DiscardGroup,
    GroupVerdict,
    ReadyTrajectory,
    SchemaError,
    SessionEnd,
    SessionResult,
    SessionTurn,
    TrajectoryChunk,
    decode_message,
    decode_verdict,
)
from prm_pipeline.audit.compare import (
    DEFAULT_TOLERANCE,
    GROUP_OUTCOMES,
    GroupFinding,
    ScoringScope,
    SessionComparison,
    Tolerance,
    compare_session,
    summarize_group,
)
from prm_pipeline.audit.rescoring import rescore

if TYPE_CHECKING:
    from scoring_workers.prm import PRMRunner


@dataclass
class AuditReport:
    """What an audit found: one :class:`GroupFinding` per group plus counts."""

    findings: list[GroupFinding]
    scope: ScoringScope
    records: dict[str, int] = field(default_factory=dict)
    resume_offsets: str = ""
    requested_groups: list[str] = field(default_factory=list)  # --groups, in the order given
    missing_groups: list[str] = field(default_factory=list)  # of those, ids no record read named

    @property
    def counts(self) -> dict[str, int]:
        counts: Counter[str] = Counter(f.outcome for f in self.findings)
        return {outcome: counts.get(outcome, 0) for outcome in GROUP_OUTCOMES}

    @property
    def sessions(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for f in self.findings:
            total.update(f.sessions)
        return dict(sorted(total.items()))

    @property
    def exit_code(self) -> int:
        """1 when a group differs; 2 when groups were asked for and none was found (nothing
        was audited: a typo or the wrong range, not a clean audit); else 0."""
        if self.requested_groups and len(self.missing_groups) == len(self.requested_groups):
            return 2
        return 1 if self.counts["differs"] else 0

    def by_group(self) -> dict[str, GroupFinding]:
        """Findings by group id (an audit of one experiment; see :meth:`by_scoped_group` for several)."""
        return {f.group_id: f for f in self.findings}

    def by_scoped_group(self) -> dict[str, GroupFinding]:
        """Findings by scoped group id (:func:`infra.experiments.scoped_group`)."""
        return {scoped_group(f.experiment_id, f.group_id): f for f in self.findings}


class Auditor:
    """Bookkeeping of one audit, independent of Kafka.

    Feed every verdict record first (:meth:`feed_verdict`), then stream trajectory
    records (:meth:`feed_trajectory`); each trajectory a verdict member references is
    re-scored once (the first record of a ``trajectory_id`` wins, as in the worker) and
    compared at once against every distinct verdict listing it, so trajectories are not
    kept in memory. :meth:`finish` waits for re-scoring and returns the report.

    ``experiment``: only this experiment's records are audited (``None``: every
    experiment's, each matched within its own).
    """

    def __init__(
        self,
        *,
        scope: ScoringScope,
        runner: PRMRunner | None,
        tol: Tolerance = DEFAULT_TOLERANCE,
        groups: Iterable[str] | None = None,
        timeout_s: float | None = 60.0,
        concurrency: int = 16,
        max_differences: int = 100,
        on_rescored: Callable[[int], None] | None = None,
        keep_channels: bool = False,
        experiment: str | None = DEFAULT_EXPERIMENT,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.experiment = experiment
        self.scope, self.runner, self.tol = scope, runner, tol
        self.requested = list(groups or ())
        self.groups = frozenset(self.requested) if self.requested else None
        self.timeout_s, self.concurrency, self.max_differences = timeout_s, concurrency, max_differences
        self.on_rescored = on_rescored
        self.keep_channels = keep_channels  # as the workers ran (worker.keep_scorer_channels)
        self.counts: Counter[str] = Counter()
        # Groups are keyed by scoped id, trajectories by (experiment, trajectory id).
        self._variants: dict[str, list[list[Any]]] = {}  # group -> [[verdict, copies]]
        self._refs: dict[tuple[str, str], list[tuple[str, int, int]]] = {}  # trajectory -> (group, variant, session)
        self._results: dict[tuple[str, int, int], SessionComparison] = {}
        self._rescored: dict[tuple[str, str], bytes] = {}  # trajectory -> digest of the record re-scored
        self._seen: dict[str, set[str]] = {}  # group -> trajectory ids on the topic
        self._streamed: set[tuple[str, str]] = set()  # trajectories streamed (turn/end records): not re-scored
        self._discards: set[str] = set()
        self._notes: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._chunks: ChunkAssembler[None] = ChunkAssembler()  # large trajectories arrive in chunk records
        self._frozen = False

    # ------------------------------------------------------------------ verdicts
    def wanted(self, group_id: str) -> bool:
        return self.groups is None or group_id in self.groups

    def _ours(self, experiment_id: str, kind: str) -> bool:
        """True when a record of ``experiment_id`` is audited here; else counted as another experiment's."""
        if self.experiment is None or experiment_id == self.experiment:
            return True
        self.counts[f"other_experiment_{kind}"] += 1
        return False

    def feed_verdict(self, value: bytes | None, headers: Any) -> GroupVerdict | None:
        """Decode and register one verdict record (skipped when filtered or undecodable)."""
        verdict = self.decode_verdict(value, headers)
        if verdict is not None:
            self.add_verdict(verdict)
        return verdict

    def decode_verdict(self, value: bytes | None, headers: Any) -> GroupVerdict | None:
        """Decode and count one verdict record; None when filtered or undecodable (then
        :meth:`add_verdict` it, after reading referenced members' turns back)."""
        if self._frozen:
            raise RuntimeError("feed every verdict before the first trajectory")
        self.counts["verdict_records"] += 1
        try:
            verdict = decode_verdict(value, headers)
        except SchemaError:
            self.counts["undecodable_verdicts"] += 1
            return None
        if not self._ours(verdict.experiment_id, "verdicts") or not self.wanted(verdict.group_id):
            return None
        return verdict

    def add_verdict(self, verdict: GroupVerdict) -> None:
        group = scoped_group(verdict.experiment_id, verdict.group_id)
        variants = self._variants.setdefault(group, [])
        for entry in variants:
            if entry[0] == verdict:
                entry[1] += 1
                return
        variants.append([verdict, 1])
        v = len(variants) - 1
        for j, session in enumerate(verdict.sessions):
            if session.status in ("scored", "failed"):
                self._refs.setdefault((verdict.experiment_id, session.trajectory_id), []).append((group, v, j))

    @property
    def sessions_to_rescore(self) -> int:
        """Distinct trajectories the registered verdicts need re-scored."""
        return len(self._refs)

    # ------------------------------------------------------------------ trajectories
    async def feed_trajectory(self, value: bytes | None, headers: Any) -> None:
        """Decode one trajectories-topic record; re-score it if a verdict needs it.

        Waits while ``concurrency`` re-scorings are in flight (backpressure on reading).
        A chunk record is buffered; the trajectory is audited when its last chunk arrives.
        A streamed session's record (``turn``, ``end``) is counted and its trajectory noted
        as seen, not re-scored (the module's docstring).
        """
        self._frozen = True
        self.counts["trajectory_records"] += 1
        try:
            message = decode_message(value, headers, kinds=ALL_KINDS)
        except SchemaError:
            self.counts["undecodable_trajectories"] += 1  # the worker dead-lettered these
            return
        match message:
            case TrajectoryChunk():
                for done in self._chunks.add(None, message, None) if self.wanted(message.group_id) else ():
                    try:
                        whole = reassembled(done)
                    except SchemaError:
                        self.counts["undecodable_trajectories"] += 1
                        continue
                    await self._feed(whole, done.value)
            case ReadyTrajectory() | DiscardGroup():
                await self._feed(message, value)
            case SessionTurn() | SessionEnd():
                self._feed_streamed(message)

    def _feed_streamed(self, message: SessionTurn | SessionEnd) -> None:
        """Count a streamed session's record and note its trajectory (seen, not re-scored)."""
        self.counts["streamed_turn_records" if isinstance(message, SessionTurn) else "streamed_end_records"] += 1
        if not self._ours(message.experiment, "trajectories") or not self.wanted(message.group_id):
            return
        self._seen.setdefault(scoped_group(message.experiment, message.group_id), set()).add(message.trajectory_id)
        self._streamed.add((message.experiment, message.trajectory_id))

    async def _feed(self, message: ReadyTrajectory | DiscardGroup, value: bytes | None) -> None:
        if not self._ours(message.experiment, "trajectories") or not self.wanted(message.group_id):
            return
        group = scoped_group(message.experiment, message.group_id)
        if isinstance(message, DiscardGroup):
            self._discards.add(group)
            return
        self.add_trajectory_seen(message)
        tid = (message.experiment, message.trajectory_id)
        if tid not in self._refs:
            return
        digest = hashlib.blake2b(value or b"", digest_size=16).digest()
        first = self._rescored.get(tid)
        if first is not None:
            if first != digest:
                self._notes.setdefault(group, []).append(
                    f"trajectory {tid[1]!r} was published again with a different payload; the first record "
                    "(the one the worker scored) was audited"
                )
            return
        self._rescored[tid] = digest
        while len(self._tasks) >= self.concurrency:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            self._reap()
        task = asyncio.create_task(self._rescore_and_compare(message))
        self._tasks.add(task)

    def add_trajectory_seen(self, traj: ReadyTrajectory) -> None:
        self._seen.setdefault(scoped_group(traj.experiment, traj.group_id), set()).add(traj.trajectory_id)

    def _reap(self) -> None:
        for task in [t for t in self._tasks if t.done()]:
            self._tasks.discard(task)
            task.result()  # a bug in the audit itself must not pass silently

    async def _rescore_and_compare(self, traj: ReadyTrajectory) -> None:
        result = await rescore(self.runner, traj, timeout_s=self.timeout_s, keep_channels=self.keep_channels)
        for group_id, v, j in self._refs[(traj.experiment, traj.trajectory_id)]:
            recorded = self._variants[group_id][v][0].sessions[j]
            self._results[(group_id, v, j)] = compare_session(recorded, result, scope=self.scope, tol=self.tol)
        if self.on_rescored is not None:
            self.on_rescored(1)

    # ------------------------------------------------------------------ report
    def _unrescored(self, experiment_id: str, recorded: SessionResult) -> SessionComparison:
        """The comparison of a member no trajectory record was re-scored for: a streamed one is
        ``not_rescorable`` (its records are on the topic; the audit does not re-score streamed
        sessions), any other ``missing_trajectory`` (:func:`compare_session` without a result)."""
        comparison = compare_session(recorded, None, scope=self.scope, tol=self.tol)
        if comparison.outcome == "missing_trajectory" and (experiment_id, recorded.trajectory_id) in self._streamed:
            return SessionComparison(
                outcome="not_rescorable",
                notes=[
                    f"trajectory {recorded.trajectory_id!r} was streamed (turn/end records): the audit re-scores "
                    "ready trajectories only"
                ],
            )
        return comparison

    async def finish(self, *, resume_offsets: str = "") -> AuditReport:
        try:
            if self._tasks:
                await asyncio.wait(self._tasks)
            self._reap()
        except BaseException:
            for task in self._tasks:
                task.cancel()
            raise
        findings: list[GroupFinding] = []
        for group_id, variants in self._variants.items():  # scoped ids; findings name the experiment apart
            experiment_id, bare = split_scoped(group_id)
            comparisons = [
                [
                    self._results.get((group_id, v, j)) or self._unrescored(experiment_id, s)
                    for j, s in enumerate(verdict.sessions)
                ]
                for v, (verdict, _copies) in enumerate(variants)
            ]
            finding = summarize_group(
                bare,
                [(verdict, copies) for verdict, copies in variants],
                comparisons,
                scope=self.scope,
                trajectories_seen=self._seen.get(group_id, ()),
                discard_seen=group_id in self._discards,
                max_differences=self.max_differences,
                notes=self._notes.get(group_id, ()),
            )
            finding.experiment_id = experiment_id
            findings.append(finding)
        for group_id in sorted((set(self._seen) | self._discards) - set(self._variants)):
            experiment_id, bare = split_scoped(group_id)
            findings.append(
                GroupFinding(
                    group_id=bare,
                    experiment_id=experiment_id,
                    outcome="trajectory_without_verdict",
                    trajectories=sorted(self._seen.get(group_id, ())),
                    notes=["a DiscardGroup record but no verdict"] if group_id in self._discards else [],
                )
            )
        findings.sort(key=lambda f: (f.experiment_id, f.group_id))
        requested = list(dict.fromkeys(self.requested))
        found = {f.group_id for f in findings}
        return AuditReport(
            findings=findings,
            scope=self.scope,
            records=dict(self.counts),
            resume_offsets=resume_offsets,
            requested_groups=requested,
            missing_groups=[g for g in requested if g not in found],
        )
