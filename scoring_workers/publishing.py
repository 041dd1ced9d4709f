"""What the worker writes to Kafka: verdicts and dead letters.

A decision's verdict is assembled from the ledger's stored decision and the members'
token turns (:mod:`scoring_workers.tokens`), fitted to ``kafka.max_message_bytes``
(token turns by reference, or ``verdict_too_large``: :func:`scoring_workers.verdicts.fit_verdict`),
and produced; once Kafka acknowledged it the group is finished (cleanup riding along with
the ledger's next call). Errors are answered by kind (:mod:`infra.retry`): a transient one
is raised (the caller retries), a permanent one is logged and counted and never retried in
a loop — a verdict stays decided in Redis for the sweeper, a dead letter that cannot be
written is a *poison* record, committed (the source topic still holds it).
"""

from __future__ import annotations

import logging
import time

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from infra import reasons
from infra.config import PipelineConfig
from infra.experiments import DEFAULT_EXPERIMENT, UnknownExperiment, split_scoped, verdicts_topic
from infra.retry import is_permanent
from infra.schema import (
    DeadLetter,
    DiscardGroup,
    GroupVerdict,
    ReadyTrajectory,
    SessionEnd,
    SessionResult,
    SessionTurn,
    dead_letter_headers,
)
from infra.throttle import LogThrottle
from scoring_workers.dead_letters import ProcessingError, capped_letter
from scoring_workers.ledger import Decision, Ledger
from scoring_workers.telemetry import WorkerTelemetry
from scoring_workers.tokens import MemberTokens
from scoring_workers.verdicts import assemble_verdict, fit_verdict

log = logging.getLogger(__name__)


class Publisher:
    """Produces one worker's verdicts and dead letters."""

    def __init__(
        self,
        cfg: PipelineConfig,
        producer: AIOKafkaProducer,
        ledger: Ledger,
        tokens: MemberTokens,
        telemetry: WorkerTelemetry,
        worker_id: str,
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.ledger = ledger
        self._tokens = tokens
        self._telemetry = telemetry
        self.worker_id = worker_id
        self._unknown_log = LogThrottle(log, burst=20, window_s=60.0)  # one line per record: throttled

    async def publish(self, decision: Decision) -> GroupVerdict | None:
        """Produce the decision's verdict, then finish its group; the verdict once Kafka
        acknowledged it. None when Kafka refused it for good (an authorization or topic error:
        the operator must act) — it stays decided in Redis, so the sweeper tries again after
        the re-publish grace, never in a tight loop and never holding up other records or
        groups. A transient error is raised: the caller retries."""
        verdict, topic, value, headers = await self._verdict_of(decision)
        try:
            await self.producer.send_and_wait(topic, value, key=verdict.group_id.encode(), headers=headers)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            grace_s = self.cfg.worker.republish_grace_s
            self._telemetry.publish_failures.labels(type(exc).__name__).inc()
            log.error(
                "worker %s: verdict for group %s refused by Kafka (%s: %s); it stays decided and is "
                "re-published after %.0fs",
                self.worker_id,
                verdict.group_id,
                type(exc).__name__,
                exc,
                grace_s,
            )
            await self.ledger.postpone(decision.group_id, grace_s)
            return None
        self._published(decision, verdict, time.time())
        return verdict

    async def _verdict_of(self, decision: Decision) -> tuple[GroupVerdict, str, bytes, list[tuple[str, bytes]]]:
        """The verdict of ``decision`` as it goes to Kafka: (verdict, topic, value, headers), fitted
        to ``kafka.max_message_bytes`` (token turns by reference, or ``verdict_too_large``)."""
        experiment_id, group_id = split_scoped(decision.group_id)
        if decision.state.decision == "discard":  # listed without results: no tokens needed
            members = [m.result for m in decision.members]
        else:
            members = await self._tokens.members(decision.group_id, decision.members, experiment_id=experiment_id)
        full = assemble_verdict(group_id, decision.state, members)
        if experiment_id != DEFAULT_EXPERIMENT:
            full = msgspec.structs.replace(full, experiment_id=experiment_id)
        limit = self.cfg.kafka.max_message_bytes
        verdict, value, headers = fit_verdict(full, limit, self._tokens.references(decision.members))
        if verdict is not full and verdict.reason_code != reasons.VERDICT_TOO_LARGE:
            log.info(
                "group=%s: verdict too large for kafka.max_message_bytes=%d (as a compressed batch) with its "
                "members' token turns: published with their records' coordinates instead "
                "(worker.verdict_tokens: auto)",
                verdict.group_id,
                limit,
            )
        elif verdict is not full:
            log.warning(
                "group=%s: verdict too large for kafka.max_message_bytes=%d (as a compressed batch), published as %s",
                verdict.group_id,
                limit,
                verdict.reason[:200],
            )
        return verdict, verdicts_topic(self.cfg.topics.verdicts, experiment_id), value, headers

    def _published(self, decision: Decision, verdict: GroupVerdict, sent_at: float) -> None:
        """Kafka acknowledged ``verdict``: finish its group (cleanup that rides along with the next ledger call)."""
        experiment_id, _ = split_scoped(decision.group_id)
        self.ledger.finish_soon(decision.group_id)
        self._tokens.forget_group(decision.group_id)
        self._telemetry.experiment_verdicts.labels(experiment_id, verdict.status).inc()
        self._telemetry.observe_stages(verdict, sent_at)
        self._telemetry.verdicts.labels(verdict.status, reasons.metric_label(verdict.status, verdict.reason_code)).inc()
        log.info(
            "group=%s verdict=%s code=%s reason=%s sessions=%d by=%s",
            verdict.group_id,
            verdict.status,
            verdict.reason_code or "-",
            verdict.reason,
            len(verdict.sessions),
            self.worker_id,
        )

    async def reject_unknown(
        self,
        record: ConsumerRecord,
        message: ReadyTrajectory | DiscardGroup | SessionTurn | SessionEnd,
        experiment_id: str,
        attempt: int,
    ) -> None:
        """A record naming an experiment this worker does not serve: the record is dead-lettered
        (``UnknownExperiment``: ``prm-pipeline dead-letters`` shows it, and redrives it once the
        experiment is declared) and its group is rejected (``unknown_experiment``) on the default
        verdicts topic, without touching the ledger (ids named by producers must not grow
        Redis). Every such record says so again; the trainer's dedupe keeps one verdict per group."""
        await self.dead_letter(
            record,
            UnknownExperiment(
                f"experiment {experiment_id!r} is not in the experiment registry of worker {self.worker_id} "
                "(never added, removed, or its record was refused); declare it (prm-pipeline experiment add), then "
                "redrive this record"
            ),
            attempt,
        )
        members = []
        if isinstance(message, ReadyTrajectory):
            members = [
                SessionResult.failure(
                    code=reasons.UNKNOWN_EXPERIMENT,
                    detail=f"experiment {experiment_id!r} is not served",
                    session_id=message.session_id,
                    trajectory_id=message.trajectory_id,
                    outcome_reward=message.outcome_reward,
                    is_eval=message.is_eval,
                    policy_version=message.policy_version,
                    created_at=message.created_at,
                )
            ]
        verdict = GroupVerdict(
            group_id=message.group_id,
            status="rejected",
            reason_code=reasons.UNKNOWN_EXPERIMENT,
            reason=f"unknown_experiment: {experiment_id!r} is not in the experiment registry of worker "
            f"{self.worker_id} (never added, removed, or its record was refused)",
            group_size=0 if isinstance(message, DiscardGroup) else message.group_size,
            sessions=members,
            worker_id=self.worker_id,
            decided_at=time.time(),
            experiment_id=experiment_id,
        )
        _, value, headers = fit_verdict(verdict, self.cfg.kafka.max_message_bytes)
        await self.producer.send_and_wait(
            self.cfg.topics.verdicts, value, key=verdict.group_id.encode(), headers=headers
        )
        self._telemetry.verdicts.labels("rejected", reasons.UNKNOWN_EXPERIMENT).inc()
        self._unknown_log.log(
            logging.WARNING, "group=%s: rejected, unknown experiment %r", message.group_id, experiment_id
        )

    async def dead_letter(self, record: ConsumerRecord, error: BaseException, attempt: int) -> DeadLetter:
        """Dead-letter ``record``; the letter as written (or as it would have been).

        The payload is capped so that the whole dead letter — payload, key and headers —
        fits ``kafka.max_message_bytes``. If Kafka still refuses it for good, the record's
        coordinates are logged and counted (``prm_worker_poison_total``) and the record is
        committed: the source topic still holds it for audit.
        """
        cause = error.cause if isinstance(error, ProcessingError) else error
        letter, key = capped_letter(
            record,
            cause,
            attempt,
            worker_id=self.worker_id,
            max_message_bytes=self.cfg.kafka.max_message_bytes,
            dead_letter_max_bytes=self.cfg.worker.dead_letter_max_bytes,
        )
        try:
            await self.producer.send_and_wait(
                self.cfg.topics.dead_letters, letter.payload, key=key, headers=dead_letter_headers(letter)
            )
        except Exception as exc:
            if not is_permanent(exc):
                raise
            self._telemetry.poison.inc()
            log.error(
                "worker %s: POISON record %s:%d offset %d could not be dead-lettered (%s: %s); "
                "committed without a dead letter (the source topic keeps it): %s: %s",
                self.worker_id,
                record.topic,
                record.partition,
                record.offset,
                type(exc).__name__,
                exc,
                letter.error_class,
                letter.error_message[:300],
            )
        else:
            self._telemetry.dead_lettered.labels(letter.error_class).inc()
            log.warning(
                "dead-lettered %s:%d offset %d: %s: %s",
                record.topic,
                record.partition,
                record.offset,
                letter.error_class,
                letter.error_message[:300],
            )
        return letter
