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

from infra.config import PipelineConfig
from infra.experiments import turn_samples_topic
from infra.kafka import ensure_topics, make_consumer
from infra.schema import SchemaError, TurnSample, decode_turn_sample

__all__ = ["OnlineTurnRule", "Decision", "TurnSampleReader", "sample_advantages", "DEFAULT_MAX_SESSIONS"]

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
