"""OpenClaw-RL's online mode, trainer-side: each judged turn is a sample as soon as it is judged.

A deployed agent's sessions may stay open for hours, or never end. The workers publish a
:class:`~infra.schema.TurnSample` per judged turn of a streamed session on
``topics.turn_samples`` (keyed by session, so a session's samples arrive in the order
they were judged), and a trainer with ``recipe: openclaw_turns`` reads them with
:class:`OnlineTurnRule` deciding, per sample, whether it trains — OpenClaw-RL's own
per-session rule, as its proxy applies it when a judge task finishes:

* a turn is **excluded** when it has no next state or its score is ``0``;
* **at least one**: an excluded turn *with* a next state is included anyway when the
  session has no included sample *so far* (samples already decided, in arrival order),
  so a leading neutral turn is kept even if a later turn turns out effective;
* the session's last turn (no next state, sent at its ``end``) is excluded and clears
  the session's count: a turn decided afterwards sees zero, as upstream.

An excluded sample still reaches the trainer, with its loss mask all zero (upstream
sends it too). Each sample is a group of one: reward = score, advantage = reward over
the turn's response tokens (:func:`sample_advantages`).

:class:`TurnSampleConsumer` is the trainer's end of the topic (``prm-pipeline trainer`` with
``trainer.online_samples``): it decides each sample with the rule, drops repeats, and
batches the samples that train as rows of one (:func:`export_sample`) with the
verdict consumer's batching and commit discipline. :class:`TurnSampleReader` gives a
training loop of its own every sample with its decision.

Memory is bounded: the rule keeps a counter and the decided turn ids per open session,
for at most ``max_sessions`` sessions (the least recently seen is forgotten first: a
forgotten session's next sample starts from zero, as after ``session_done``).
Redelivered samples (at-least-once) get the decision they got the first time.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from aiokafka.structs import ConsumerRecord, TopicPartition

from infra.config import PipelineConfig
from infra.experiments import turn_samples_topic
from infra.kafka import ensure_topics, make_consumer
from infra.schema import SchemaError, TurnSample, decode_turn_sample

from .batch import ExportedGroup, ExportedRow
from .consumer import DedupeKey, VerdictConsumer, _Ticket

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "Decision",
    "OnlineTurnRule",
    "TurnSampleConsumer",
    "TurnSampleReader",
    "export_sample",
    "sample_advantages",
    "sample_key",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 100_000
"""Open sessions the rule remembers (a counter and the decided turn ids each)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the trainer does with one sample: ``train`` (loss mask all one) or not (all zero)."""

    train: bool
    rescued: bool = False  # included only by the at-least-one rule
    duplicate: bool = False  # seen before: the first decision, repeated


@dataclass(slots=True)
class _Session:
    included: int = 0
    decided: dict[str, Decision] = field(default_factory=dict)


class OnlineTurnRule:
    """OpenClaw-RL's per-session exclusion with the at-least-one rule, applied in arrival order."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[tuple[str, str], _Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def decide(self, sample: TurnSample) -> Decision:
        """Decide ``sample`` (call in the order samples arrive; a repeat gets its first answer)."""
        key = (sample.experiment_id, sample.trajectory_id)
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(key)
        seen = session.decided.get(sample.interaction_id)
        if seen is not None:
            return Decision(seen.train, seen.rescued, duplicate=True)
        exclude = not sample.has_next_state or sample.score == 0
        rescued = exclude and sample.has_next_state and session.included == 0
        decision = Decision(train=not exclude or rescued, rescued=rescued)
        if decision.train:
            session.included += 1
        if sample.last:  # session_done: upstream clears the count; nothing of it is kept
            del self._sessions[key]
        else:
            session.decided[sample.interaction_id] = decision
        return decision


class TurnSampleReader:
    """One experiment's turn samples, read in a consumer group and decided in arrival order.

    ``await batch()`` returns the samples read so far with their :class:`Decision`;
    ``await commit()`` after the trainer has taken them (at-least-once: a restart reads
    from the last commit, and a redelivered sample gets its first decision while the
    rule remembers its session). The group is ``<trainer consumer group>.turn-samples``;
    a record that is not a turn sample is logged and skipped (a trainer never stops on
    one bad record; the workers are the only writers).
    """

    def __init__(self, cfg: PipelineConfig, *, rule: OnlineTurnRule | None = None) -> None:
        self.cfg = cfg
        self.topic = turn_samples_topic(cfg.topics.turn_samples, cfg.trainer.experiment)
        self.rule = rule or OnlineTurnRule()
        self.skipped = 0
        self._consumer: Any = None

    async def start(self) -> None:
        await ensure_topics(self.cfg.kafka, self.cfg.topics, [self.topic])
        self._consumer = make_consumer(
            self.cfg.kafka, self.topic, group_id=f"{self.cfg.trainer.consumer_group}.turn-samples"
        )
        await self._consumer.start()

    async def aclose(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def batch(self, timeout_s: float = 1.0) -> list[tuple[TurnSample, Decision]]:
        """The samples that arrived within ``timeout_s``, each decided (:meth:`OnlineTurnRule.decide`)."""
        polled = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000))
        out = []
        for records in polled.values():
            for record in records:
                try:
                    sample = decode_turn_sample(record.value, record.headers)
                except SchemaError as exc:
                    self.skipped += 1
                    log.warning("turn sample %s:%d@%d skipped: %s", record.topic, record.partition, record.offset, exc)
                    continue
                out.append((sample, self.rule.decide(sample)))
        return out

    async def commit(self) -> None:
        await self._consumer.commit()


def sample_advantages(sample: TurnSample, decision: Decision) -> tuple[np.ndarray, np.ndarray]:
    """``(advantages, loss_mask)`` over the sample's response tokens: the score broadcast
    (a group of one, no normalisation), masked out when the sample does not train."""
    n = len(sample.output_tokens)
    mask = np.full(n, decision.train, dtype=bool)
    return np.where(mask, np.float32(sample.score), np.float32(0.0)).astype(np.float32), mask


def sample_key(sample: TurnSample) -> DedupeKey:
    """The sample's identity in the trainer's seen-set: ``(experiment_id, "<trajectory>/<turn>", 0)``
    (ids never hold ``/``, so no two turns share a key, nor a turn and a group)."""
    return (sample.experiment_id, f"{sample.trajectory_id}/{sample.interaction_id}", 0)


def export_sample(sample: TurnSample) -> ExportedGroup:
    """A sample that trains as a group of one with one row: the turn's prompt and output, the
    output in the loss with the score as its token reward (OpenClaw-RL: reward = score,
    advantage = reward over the response), ``turn_index`` 0 on it, outcome reward = score."""
    prompt, output = sample.prompt_tokens, sample.output_tokens
    start, length = len(prompt), len(prompt) + len(output)
    advantages, mask = sample_advantages(sample, Decision(train=True))
    loss_mask = np.zeros(length, dtype=bool)
    loss_mask[start:] = mask
    token_rewards = np.zeros(length, dtype=np.float32)
    token_rewards[start:] = advantages
    logprobs = np.zeros(length, dtype=np.float32)
    if sample.output_logprobs is not None:
        logprobs[start:] = sample.output_logprobs
    turn_index = np.full(length, -1, dtype=np.int32)
    turn_index[start:] = 0
    row = ExportedRow(
        input_ids=np.concatenate([prompt, output]),
        loss_mask=loss_mask,
        logprobs=logprobs,
        token_rewards=token_rewards,
        turn_index=turn_index,
        reward=float(sample.score),
        is_truncated=False,
        session_id=sample.session_id,
        trajectory_id=sample.trajectory_id,
        leaf_id=sample.interaction_id,
    )
    return ExportedGroup(group_id=f"{sample.group_id}/{sample.interaction_id}", verdict_version=0, rows=(row,))


class TurnSampleConsumer(VerdictConsumer):
    """The trainer's end of ``topics.turn_samples``: decided samples in, :class:`TrainingBatch`\\ es out.

    The verdict consumer's lifecycle, batching (``batch_groups`` samples a batch, each a
    group of one), idle flush, stop, rebalance handling and commit discipline, for turn
    samples: per record, decode (an undecodable record is logged, counted as
    ``pipeline/turn_samples/undecodable`` and skipped) -> another experiment's sample is
    skipped -> :class:`OnlineTurnRule` decides it, in arrival order -> a repeat of a
    sample this instance has taken is acknowledged (``turn_samples/duplicate``: the
    seen-set, keyed by :func:`sample_key`) -> an excluded sample is acknowledged
    (``turn_samples/excluded``; OpenClaw-RL sends it with an all-zero loss mask, which
    trains nothing) -> the sample waits in the buffer as one row (:func:`export_sample`).
    An offset is committed only after the step that used its sample is done.

    The group is ``<trainer consumer group>.turn-samples``; the topic is created if no
    worker has written to it yet (a trainer may start first). There is no durable dedupe
    store and no group filter or staleness bound (samples carry no policy version):
    across restarts, committed offsets alone decide what is read again, and the rule
    starts every session from zero, as a restarted OpenClaw-RL proxy does.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        rule: OnlineTurnRule | None = None,
        batch_groups: int | None = None,
        device: str | torch.device | None = None,
        poll_timeout_ms: int = 200,
        consumer_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            cfg,
            batch_groups=batch_groups,
            group_filter=None,
            group_id=f"{cfg.trainer.consumer_group}.turn-samples",
            device=device,
            poll_timeout_ms=poll_timeout_ms,
            max_policy_lag=None,
            consumer_overrides=consumer_overrides,
        )
        self.topic = turn_samples_topic(cfg.topics.turn_samples, self.experiment)
        self.rule = rule or OnlineTurnRule()

    async def start(self) -> None:
        await ensure_topics(self.cfg.kafka, self.cfg.topics, [self.topic])
        await super().start()

    async def _process(self, records: list[ConsumerRecord]) -> None:
        if self._consumer is None or self._committer is None:
            return
        assigned = self._consumer.assignment()
        tracker = self._committer.tracker
        for record in records:
            tp = TopicPartition(record.topic, record.partition)
            if tp not in assigned:
                continue  # revoked while the fetch was in flight: the new owner has it
            tracker.begin(tp, record.offset)
            taken = self._take(record)
            if taken is None:
                tracker.finish(tp, record.offset)
            else:
                self._buffer.append((taken[1], _Ticket(tp, record.offset, taken[0])))

    def _take(self, record: ConsumerRecord) -> tuple[DedupeKey, ExportedGroup] | None:
        """The sample's key and row when it trains; None when it is finished at once."""
        m = self.metrics
        try:
            sample = decode_turn_sample(record.value, record.headers)
        except SchemaError as exc:
            m.count("turn_samples/undecodable")
            log.error("undecodable turn sample at %s:%d offset %d skipped: %s", *_where(record), exc)
            return None
        if sample.experiment_id != self.experiment:
            m.count("turn_samples/wrong_experiment")
            if self._wrong_experiment_warning.due():
                log.warning(
                    "turn sample of experiment %r at %s:%d offset %d skipped: this trainer trains %r",
                    sample.experiment_id,
                    *_where(record),
                    self.experiment,
                )
            return None
        decision = self.rule.decide(sample)
        key = sample_key(sample)
        if self._is_duplicate(key):
            m.count("turn_samples/duplicate")
            return None
        self._remember(key)
        m.count("turn_samples/received")
        if not decision.train:
            m.count("turn_samples/excluded")
            return None
        if decision.rescued:
            m.count("turn_samples/rescued")
        m.count("turn_samples/trained")
        return key, export_sample(sample)


def _where(record: ConsumerRecord) -> tuple[str, int, int]:
    return record.topic, record.partition, record.offset
