"""The experiments one worker serves: its config file's (``default``) and the registry's.

Each experiment has a runtime (:class:`Experiment`): its own scorer runner, group
timeout, weight, quotas and topics. :class:`Fleet` keeps them and applies the registry
(:mod:`infra.registry`) as it changes:

* **declared** — the record is checked before anything is built: every scorer module
  must be under the worker's ``worker.allowed_scorer_modules``, every argument it sets
  must be one the scorer class lets records set (operator-only ones come from the
  worker's ``worker.scorer_profiles``: :mod:`scoring_workers.prm.capabilities`), every
  judge URL under the worker's judge host allow-list
  (:func:`~scoring_workers.judge.hosts.effective_allow_list`: the explicit
  ``worker.allowed_judge_hosts``, or exactly the hosts of the worker's own file). A
  refused record is logged and counted (``prm_worker_registry_records_total{outcome=
  "refused"}``) and changes nothing: an experiment already running keeps its last good
  declaration, the others are untouched. A replaced declaration's runner is closed once
  the records it scores are done.
* **removed** — the experiment *retires*: its records are still scored for its group
  timeout (its open groups finish, or time out), counted from the removal record's
  timestamp, then its topic is dropped from the subscription and its runner closed.
  From then on a record naming it is ``unknown_experiment``.

A worker that starts reads the whole registry (:meth:`Fleet.settle` first): of each
experiment only its current declaration counts, and one removed longer ago than its
group timeout is not declared at all — a removed experiment is never served again,
not subscribed to, not retired once more for a whole group timeout by every worker
that starts after its removal; one removed more recently retires for the rest of it.

Building a runner may take a while (a scorer's start-up); the worker applies registry
records in a background task, so polling never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from infra.config import PipelineConfig, PRMConfig
from infra.experiments import DEFAULT_EXPERIMENT, experiment_of_topic, trajectories_topic, verdicts_topic
from infra.registry import ExperimentSpec, RegistryRecord
from infra.schema import (
    DiscardGroup,
    ExperimentMismatch,
    ReadyTrajectory,
    ScorerInfo,
    SessionEnd,
    SessionTurn,
    check_channel,
)
from scoring_workers.judge.hosts import check_config_judge_hosts, effective_allow_list, judge_hosts_allowed
from scoring_workers.prm.capabilities import record_prm
from scoring_workers.prm.protocols import ScoringRunner
from scoring_workers.verdicts import encode_scorers

log = logging.getLogger(__name__)

__all__ = ["Experiment", "Fleet"]


@dataclass
class Experiment:
    """What a worker needs to score one experiment's records."""

    experiment_id: str
    runner: (
        ScoringRunner | None
    )  # None: scoring is off (the config runs no scorer, or a retired experiment's leftovers)
    scorers_blob: bytes
    group_timeout_s: float
    weight: float = 1.0
    max_in_flight: int | None = None
    spec: ExperimentSpec | None = None  # None: the worker's own config file
    trajectories_topic: str = ""
    verdicts_topic: str = ""
    retire_at: float | None = None  # monotonic deadline once removed from the registry
    # its records being processed -> the task processing each
    in_flight: dict[Any, asyncio.Task[Any]] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return "active" if self.retire_at is None else "retiring"


def _blob(runner: ScoringRunner | None) -> bytes:
    """The scorers a verdict names: those ``runner`` runs (none without a runner)."""
    if runner is None:
        return encode_scorers([])
    return encode_scorers([ScorerInfo(s.name, s.version) for s in runner.scorer_infos()])


class Fleet:
    """The worker's experiments by id, and which trajectories topic belongs to which."""

    def __init__(
        self,
        cfg: PipelineConfig,
        default_runner: ScoringRunner | None,
        *,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._on_refused = on_refused or (lambda experiment_id, why: None)
        default = Experiment(
            DEFAULT_EXPERIMENT,
            default_runner,
            _blob(default_runner),
            cfg.worker.group_timeout_s,
            trajectories_topic=cfg.topics.trajectories,
            verdicts_topic=cfg.topics.verdicts,
        )
        self._experiments: dict[str, Experiment] = {DEFAULT_EXPERIMENT: default}
        self._by_topic: dict[str, Experiment] = {default.trajectories_topic: default}
        self._closing: set[asyncio.Task[None]] = set()
        self._hosts = effective_allow_list(cfg.prm, cfg.worker.allowed_judge_hosts, cfg.worker.scorer_profiles)

    # ------------------------------------------------------------------ lookups
    def get(self, experiment_id: str) -> Experiment | None:
        """The runtime of ``experiment_id``; None when this worker does not serve it."""
        return self._experiments.get(experiment_id)

    def retired(self, experiment_id: str) -> Experiment:
        """Settings for the leftover groups of an experiment no longer served: the worker's group
        timeout, no scorers (its verdicts must not name another experiment's)."""
        return Experiment(
            experiment_id,
            None,
            _blob(None),
            self.cfg.worker.group_timeout_s,
            trajectories_topic=trajectories_topic(self.cfg.topics.trajectories, experiment_id),
            verdicts_topic=verdicts_topic(self.cfg.topics.verdicts, experiment_id),
        )

    def of_topic(self, topic: str) -> Experiment | None:
        return self._by_topic.get(topic)

    def experiment_of(self, topic: str) -> str:
        """A record's experiment: its topic's, never one the record names (the topic is the
        tenant: docs/security.md). A topic no longer served (its experiment retired while its
        records were fetched) still names its experiment, which the worker then does not serve."""
        owner = self._by_topic.get(topic)
        if owner is not None:
            return owner.experiment_id
        return experiment_of_topic(self.cfg.topics.trajectories, topic) or DEFAULT_EXPERIMENT

    def admit(self, topic: str, message: Any) -> Any:
        """``message``, or the :class:`~infra.schema.ExperimentMismatch` it is when it names
        another experiment than ``topic``'s (the worker dead-letters it as an invalid record,
        as it does a :class:`~infra.schema.SchemaError` from decoding)."""
        if isinstance(message, (ReadyTrajectory, DiscardGroup, SessionTurn, SessionEnd)):
            try:
                check_channel(message, self.experiment_of(topic), topic)
            except ExperimentMismatch as exc:
                return exc
        return message

    def topics(self) -> list[str]:
        """The trajectories topics to consume (sorted; the default experiment's first)."""
        default = self._experiments[DEFAULT_EXPERIMENT].trajectories_topic
        return [default] + sorted(t for t in self._by_topic if t != default)

    def __iter__(self) -> Iterator[Experiment]:
        """Every experiment served (a snapshot: the fleet may change while it is iterated)."""
        return iter(list(self._experiments.values()))

    def states(self) -> dict[str, int]:
        counts = {"active": 0, "retiring": 0}
        for e in self._experiments.values():
            counts[e.state] += 1
        return counts

    # ------------------------------------------------------------------ registry
    def settle(self, records: list[RegistryRecord], now: float | None = None) -> list[RegistryRecord]:
        """The records of a catch-up (the registry read from its beginning) worth applying,
        in their order: per experiment, its last good record and the refused ones after it
        (they are reported again). A removal keeps the declaration before it only while
        its open groups may still need scoring: removed at least its group timeout ago
        (by the record's timestamp, unix time ``now``), the experiment leaves nothing —
        no runner built, no topic subscribed, no retirement."""
        now = time.time() if now is None else now
        by_experiment: dict[str, list[int]] = {}
        for i, record in enumerate(records):
            by_experiment.setdefault(record.experiment_id, []).append(i)
        keep: set[int] = set()
        for experiment_id, indices in by_experiment.items():
            good = [i for i in indices if not records[i].error]
            keep.update(i for i in indices if not good or i > good[-1])
            if not good or not records[good[-1]].removal:
                keep.update(good[-1:])
                continue
            declared = [i for i in good if records[i].spec is not None]
            if not declared:
                continue  # removed, its declaration compacted away: nothing to serve
            spec = records[declared[-1]].spec
            assert spec is not None
            removal = next(i for i in good if i > declared[-1])  # the first removal after it
            timeout_s = spec.group_timeout_s or self.cfg.worker.group_timeout_s
            removed_at_ms = records[removal].timestamp_ms
            if removed_at_ms > 0 and removed_at_ms / 1000 + timeout_s <= now:
                log.info(
                    "experiment %s was removed %.0fs ago, over its group timeout (%gs): not served",
                    experiment_id,
                    now - removed_at_ms / 1000,
                    timeout_s,
                )
                continue
            keep.update((declared[-1], removal))
        return [records[i] for i in sorted(keep)]

    async def apply(self, record: RegistryRecord) -> bool:
        """Apply one registry record; True when the set of topics changed."""
        if record.error:
            self._refuse(record.experiment_id, record.error)
            return False
        if record.spec is None:
            return self._retire(record.experiment_id, record.timestamp_ms)
        return await self._declare(record.spec)

    async def _declare(self, spec: ExperimentSpec) -> bool:
        experiment_id = spec.experiment_id
        try:  # as data first: capabilities (operator-only arguments, profiles), then judge hosts; then build
            prm = record_prm(
                spec.prm,
                self.cfg.worker.scorer_profiles,
                allowed_prefixes=self.cfg.worker.allowed_scorer_modules,
                key=f"experiment {experiment_id!r} prm",
            )
            check_config_judge_hosts(prm, self._hosts, f"experiment {experiment_id!r} prm")
            runner = await self._build(spec, prm)
        except Exception as exc:  # noqa: BLE001 - a refused declaration must never stop the worker
            self._refuse(experiment_id, f"{type(exc).__name__}: {exc}")
            return False
        old = self._experiments.get(experiment_id)
        new = Experiment(
            experiment_id,
            runner,
            _blob(runner),
            spec.group_timeout_s or self.cfg.worker.group_timeout_s,
            weight=spec.weight,
            max_in_flight=spec.max_in_flight,
            spec=spec,
            trajectories_topic=trajectories_topic(self.cfg.topics.trajectories, experiment_id),
            verdicts_topic=verdicts_topic(self.cfg.topics.verdicts, experiment_id),
        )
        self._experiments[experiment_id] = new
        self._by_topic[new.trajectories_topic] = new
        if old is not None:
            new.in_flight = old.in_flight  # slots in use stay counted; the old runner finishes them
            self._close_later(old)
        log.info(
            "experiment %s %s: %d scorer(s) %s, weight %g, max_in_flight %s, group_timeout_s %g, topic %s",
            experiment_id,
            "replaced" if old is not None else "declared",
            len(prm.scorers),
            [s.path for s in prm.scorers],
            new.weight,
            new.max_in_flight,
            new.group_timeout_s,
            new.trajectories_topic,
        )
        return old is None

    async def _build(self, spec: ExperimentSpec, prm: PRMConfig) -> ScoringRunner:
        from scoring_workers.judge.limits import JudgeQuota, judge_quota
        from scoring_workers.prm import PRMRunner

        # every judge client the scorers build is this tenant's: it takes the experiment's quota (if any)
        # and sets no process-wide judge limit (its own limits and breaker are its own)
        asked = spec.judge_quota
        quota = JudgeQuota(spec.experiment_id, *(() if asked is None else (asked.max_in_flight, asked.rps)))
        with judge_hosts_allowed(self._hosts), judge_quota(quota):
            return await PRMRunner.create(prm, allowed_prefixes=self.cfg.worker.allowed_scorer_modules)

    def _refuse(self, experiment_id: str, why: str) -> None:
        kept = self._experiments.get(experiment_id)
        log.error(
            "experiment registry: record for %r refused (%s); %s",
            experiment_id,
            why[:500],
            "it keeps its previous declaration" if kept is not None else "it is not served",
        )
        self._on_refused(experiment_id, why)

    def _retire(self, experiment_id: str, removed_at_ms: int = 0) -> bool:
        """Retire ``experiment_id`` for its group timeout from its removal (``removed_at_ms``,
        the record's unix timestamp; 0: unknown, now), at most the whole timeout."""
        experiment = self._experiments.get(experiment_id)
        if experiment is None or experiment_id == DEFAULT_EXPERIMENT or experiment.retire_at is not None:
            return False
        remaining = experiment.group_timeout_s
        if removed_at_ms > 0:
            remaining = min(remaining, max(0.0, removed_at_ms / 1000 + remaining - time.time()))
        experiment.retire_at = time.monotonic() + remaining
        log.info(
            "experiment %s removed: its records are scored for %gs more (open groups finish or time out), "
            "then it stops",
            experiment_id,
            remaining,
        )
        return False

    def expire(self, now: float | None = None) -> bool:
        """Drop retired experiments whose time is up; True when the topics changed."""
        now = time.monotonic() if now is None else now
        gone = [e for e in self._experiments.values() if e.retire_at is not None and e.retire_at <= now]
        for experiment in gone:
            del self._experiments[experiment.experiment_id]
            self._by_topic.pop(experiment.trajectories_topic, None)
            self._close_later(experiment)
            log.info("experiment %s stopped: no longer served", experiment.experiment_id)
        return bool(gone)

    def _close_later(self, experiment: Experiment) -> None:
        """Close ``experiment``'s runner once the records it is scoring are done."""
        if experiment.runner is None or experiment.spec is None:
            return
        runner = experiment.runner
        pending = [t for t in set(experiment.in_flight.values()) if not t.done()]

        async def close() -> None:
            if pending:
                await asyncio.wait(pending)
            with contextlib.suppress(Exception):
                await runner.aclose()

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        """Close every registry experiment's runner (the default one belongs to the worker)."""
        for experiment in list(self._experiments.values()):
            self._close_later(experiment)
        if self._closing:
            await asyncio.wait(list(self._closing))
