"""Online turn samples (OpenClaw-RL's mode): each judged turn of a streamed session, at once.

With ``worker.turn_samples`` on, a worker publishes a :class:`~infra.schema.TurnSample` on
``topics.turn_samples`` (``.<experiment>`` for another experiment, key: the session id)
as soon as the OpenClaw judge has scored a streamed turn — when the turn's next state
arrived, one judge call after it — and one for the session's last turn at its ``end``
(no next state: OpenClaw-RL submits it excluded and clears the session's count). The
group's verdict follows at the end as always; the samples are for a trainer that learns
while sessions are still open (:mod:`shaper.online`).

A sample carries the judge's unweighted vote result and ``has_next_state`` (from the
judge's own turn observation), the turn's full prompt and its output tokens and
log-probs. Only a turn's first judged next state makes a sample (a branch that gives
it a second one changes the verdict's branches, not the online stream: upstream
sessions do not branch). A sample that cannot be sent is logged and counted
(:attr:`TurnSamples.failed`); the verdict is unaffected.
"""

from __future__ import annotations

import logging
import time

from aiokafka import AIOKafkaProducer

from infra.config import KafkaConfig, TopicsConfig
from infra.experiments import split_scoped, turn_samples_topic
from infra.kafka import ensure_topics
from infra.modes import JUDGE_SCORER
from infra.schema import Interaction, SessionEnd, SessionTurn, TurnSample, encode
from scoring_workers.prm.streamed import StreamedResult

__all__ = ["TurnSamples"]

log = logging.getLogger(__name__)


class TurnSamples:
    """Builds and sends a worker's online turn samples."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        worker_id: str,
        *,
        judge: str = JUDGE_SCORER,
    ) -> None:
        self.producer = producer
        self.kafka, self.topics = kafka, topics
        self._created: set[str] = set()  # topics this worker made sure exist
        self.worker_id = worker_id
        self.judge = judge
        self.sent = 0
        self.failed = 0

    async def judged(
        self, group: str, child: SessionTurn, turn: Interaction, number: int, results: list[StreamedResult]
    ) -> None:
        """``turn`` was judged when ``child`` (its next state's turn) arrived."""
        result = next((r for r in results if r.name == self.judge and r.scalar is not None), None)
        if result is None or turn.model_response is None:
            return
        has_next = next((bool(o.value) for o in result.observations if o.metric_id == "has_next_state"), True)
        await self._send(
            group,
            child.session_id,
            child.trajectory_id,
            child.group_id,
            turn,
            number,
            result.scalar or 0.0,
            has_next,
            last=False,
        )

    async def ended(self, group: str, end: SessionEnd, leaves: list[tuple[Interaction, int]]) -> None:
        """The session ended: its last turns (no next state) as excluded samples that close it."""
        for k, (turn, number) in enumerate(leaves):
            if turn.model_response is not None:
                await self._send(
                    group,
                    end.session_id,
                    end.trajectory_id,
                    end.group_id,
                    turn,
                    number,
                    0.0,
                    False,
                    last=k == len(leaves) - 1,
                )

    async def _send(
        self,
        group: str,
        session_id: str,
        trajectory_id: str,
        group_id: str,
        turn: Interaction,
        number: int,
        score: float,
        has_next: bool,
        *,
        last: bool,
    ) -> None:
        experiment_id, _ = split_scoped(group)
        mr = turn.model_response
        assert mr is not None
        sample = TurnSample(
            session_id=session_id,
            trajectory_id=trajectory_id,
            group_id=group_id,
            interaction_id=turn.interaction_id,
            turn=max(1, number),
            scorer=self.judge,
            score=score,
            has_next_state=has_next,
            prompt_tokens_raw=bytes(mr.input_tokens_raw),
            output_tokens_raw=mr.output_tokens_raw,
            output_logprobs_raw=mr.output_logprobs_raw,
            last=last,
            judged_at=time.time(),
            worker_id=self.worker_id,
            experiment_id=experiment_id,
        )
        value, headers = encode(sample)
        topic = turn_samples_topic(self.topics.turn_samples, experiment_id)
        try:
            if topic not in self._created:
                await ensure_topics(self.kafka, self.topics, [topic])
                self._created.add(topic)
            await self.producer.send_and_wait(topic, value, key=session_id.encode(), headers=headers)
        except Exception as exc:  # noqa: BLE001 - the verdict does not depend on it: say so, count it
            self.failed += 1
            log.warning(
                "turn sample of session %r turn %r not sent (%s: %s)",
                session_id,
                turn.interaction_id,
                type(exc).__name__,
                exc,
            )
            return
        self.sent += 1
