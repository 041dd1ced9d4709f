"""The framework-neutral way for a trainer to get process rewards from the pipeline.

A trainer has samples (prompt tokens, response tokens, maybe log-probs and a mask of
which response tokens the model generated); the pipeline wants trajectories and answers
with verdicts. :class:`RewardClient` does the translation both ways and nothing else:

* :meth:`RewardClient.trajectory` turns one :class:`Sample` into a concat-export
  :class:`~infra.schema.ReadyTrajectory` (each run of generated tokens is one turn;
  turn *k*'s prompt is the sample's prompt plus the response before it);
* :meth:`RewardClient.publish_turn` / :meth:`RewardClient.end_session` stream a session
  turn by turn as an online proxy produces it, and :meth:`RewardClient.verdict` waits for
  its group's verdict (docs/wire.md, "Streamed sessions");
* :meth:`RewardClient.score` / :meth:`RewardClient.score_group` publish and wait —
  bounded — for the group's verdict, and return one :class:`SampleReward` per sample:
  status and reason, the raw outcome, process rewards laid out on the sample's response
  tokens (0 on tokens the model did not generate) and one value per turn.

One client serves one experiment (docs/fleet.md): ``experiment=`` or
``trainer.experiment``. It publishes to that experiment's trajectories topic (stamping
``experiment_id``) and waits on its verdicts topic; verdicts are matched by scoped group
(:func:`infra.experiments.scoped_group`), so two experiments' clients using the same
group ids never see each other's verdicts. The default experiment's topics and records
are exactly those of a client written before experiments existed. An experiment the
registry does not declare is refused when the client starts
(:class:`infra.experiments.UnknownExperiment`), rather than waiting out every timeout.

A missing verdict is ``status="timeout"`` and a rejected or discarded group says so with
its ``reason_code`` (:mod:`infra.reasons`) and reason text: never a silent 0. No trainer is imported here; the verl
adapter, the reward
gateway and the other adapters are thin layers over this module.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np

from infra.config import ConfigError, PipelineConfig
from infra.event_loop import LoopClient
from infra.experiments import check_experiment_id, scoped_group, verdicts_topic
from infra.kafka import make_consumer, partitions_of
from infra.readback import TOKENS_RETRY, VerdictTokens, needs_tokens
from infra.registry import declared_experiment
from infra.schema import (
    GroupVerdict,
    Interaction,
    ModelResponse,
    ReadyTrajectory,
    SchemaError,
    SessionEnd,
    SessionResult,
    SessionTurn,
    decode_verdict,
)
from producers.publisher import TrajectoryPublisher
from shaper.errors import ShapingInputError, VerdictMismatch

log = logging.getLogger(__name__)

RewardStatus = Literal["accepted", "rejected", "discarded", "timeout"]


@dataclass(frozen=True)
class Sample:
    """One trainer sample, as token ids.

    ``response_mask`` marks the response tokens the model generated (1) and those it
    did not (tool results, user turns: 0); each maximal run of ones is one turn. Without
    it the whole response is one turn. ``messages`` is the prompt as chat messages, for
    scorers that read text (a judge); ``decode`` on the client fills in the turns' text.
    """

    prompt_ids: Sequence[int] | np.ndarray
    response_ids: Sequence[int] | np.ndarray
    response_logprobs: Sequence[float] | np.ndarray | None = None
    response_mask: Sequence[int] | np.ndarray | None = None
    outcome_reward: float = 0.0
    messages: Sequence[dict[str, Any]] = ()
    truncated: bool = False
    session_id: str | None = None
    policy_version: int | None = None
    is_eval: bool = False


@dataclass(frozen=True)
class SampleReward:
    """What the pipeline decided about one sample.

    ``token_rewards`` has one float32 per response token: the process reward on tokens
    the model generated, 0 elsewhere (and everywhere unless ``status == "accepted"``).
    ``turn_rewards`` is the mean process reward of each turn's tokens (a scorer's scalar
    turn reward comes back as itself). ``outcome`` is the sample's raw outcome as the
    verdict recorded it (AReaL keeps outcome and process rewards apart; adding them is
    the trainer's choice).

    Why, as the verdict says it: ``reason_code`` is the verdict's registered code
    (:mod:`infra.reasons`; empty when accepted, and when no verdict came: ``status`` is
    then ``"timeout"``) for programs and metric labels, ``reason`` free text for people.
    """

    group_id: str
    trajectory_id: str
    status: RewardStatus
    reason: str
    outcome: float
    token_rewards: np.ndarray
    turn_rewards: list[float]
    turn_spans: list[tuple[int, int]]
    verdict: GroupVerdict | None = field(default=None, repr=False)
    reason_code: str = ""

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"

    def process_total(self) -> float:
        return float(self.token_rewards.sum())


def turn_spans(response_mask: Sequence[int] | np.ndarray | None, length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each generated turn inside a response of ``length`` tokens."""
    if response_mask is None:
        return [(0, length)]
    mask = np.asarray(response_mask[:length]).astype(bool)
    if not mask.any():
        return [(0, 0)]
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]


# --------------------------------------------------------------------------- verdicts
class VerdictWaiter:
    """Waits for groups' verdicts on the verdicts topic; one group-less consumer per process.

    It positions itself at the topic's end *before* anything is published (or at its
    beginning with ``from_beginning``, or at the first verdict written at or after the
    epoch time ``since``), so no verdict of ours can be missed and it never disturbs
    anyone's offsets. Recent verdicts are kept (bounded) so a caller that asks after the
    verdict passed still gets it; ``keep`` may slim each one before it is kept.

    A verdict that names its members' records (``worker.verdict_tokens: reference``, or
    ``auto`` for a verdict too large to carry the tokens) gets its members' token
    turns read back from the trajectories topic before anyone sees it
    (:mod:`infra.readback`: the worker's read-back and its ``tokens_unavailable`` rule),
    so its status is the one the trainer sees.

    ``experiment`` (default ``trainer.experiment``) picks the verdicts topic; ``recent``,
    ``arrivals`` and :meth:`expect` key groups by their scoped id, and a verdict of
    another experiment (published to the wrong topic) is never handed to a waiter.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        from_beginning: bool = False,
        since: float | None = None,
        keep_recent: int = 10_000,
        keep: Callable[[GroupVerdict], GroupVerdict] | None = None,
        experiment: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.experiment = check_experiment_id(experiment or cfg.trainer.experiment)
        self.topic = verdicts_topic(cfg.topics.verdicts, self.experiment)
        self.from_beginning = from_beginning
        self.since = since
        self.keep = keep
        self.keep_recent = keep_recent
        self.recent: OrderedDict[str, GroupVerdict] = OrderedDict()  # scoped group id -> verdict
        self.arrivals: dict[str, float] = {}  # scoped group id -> time.perf_counter() of its first verdict
        self._waiting: dict[str, asyncio.Future[GroupVerdict]] = {}
        self._task: asyncio.Task[None] | None = None
        self._consumer: Any = None
        self._tokens = VerdictTokens(cfg)

    async def start(self) -> None:
        self._consumer = make_consumer(self.cfg.kafka, group_id=None, fetch_max_wait_ms=50)
        try:
            await self._consumer.start()  # a broker that is down fails here: close the client all the same
            tps = await partitions_of(self._consumer, self.topic)
            self._consumer.assign(tps)
            if self.from_beginning:
                await self._consumer.seek_to_beginning(*tps)
            elif self.since is not None:
                found = await self._consumer.offsets_for_times({tp: int(self.since * 1000) for tp in tps})
                for tp in tps:
                    hit = found.get(tp)
                    if hit is None:  # nothing written since then on this partition
                        await self._consumer.seek_to_end(tp)
                    else:
                        self._consumer.seek(tp, hit.offset)
            else:
                await self._consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the lazy seek now, before anything is published
                await self._consumer.position(tp)
        except BaseException:
            await self._consumer.stop()
            self._consumer = None
            raise
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        await self._tokens.aclose()

    def expect(self, group_id: str) -> asyncio.Future[GroupVerdict]:
        """Register interest in ``group_id`` of this waiter's experiment (call before publishing its members)."""
        if self._task is None:
            raise RuntimeError("VerdictWaiter is not started")
        if self._task.done() and not self._task.cancelled():
            raise RuntimeError("the verdict waiter stopped") from self._task.exception()
        key = scoped_group(self.experiment, group_id)
        fut = self._waiting.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            verdict = self.recent.get(key)
            if verdict is not None:
                fut.set_result(verdict)
            else:  # members of one group in this process share the future
                self._waiting[key] = fut
        return fut

    async def wait(self, group_id: str, timeout_s: float) -> GroupVerdict | None:
        """The group's verdict, or ``None`` when none arrived within ``timeout_s``."""
        fut = self.expect(group_id)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            return None

    async def _run(self) -> None:
        try:
            while True:
                batch = await self._consumer.getmany(timeout_ms=200)
                verdicts = [
                    v for records in batch.values() for record in records if (v := self._decode(record)) is not None
                ]
                for verdict in await self._read_tokens(verdicts):
                    self._on_verdict(verdict)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the broker client gave up: every waiter learns why
            log.exception("verdict waiter stopped")
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(exc)
            raise

    @staticmethod
    def _decode(record: Any) -> GroupVerdict | None:
        try:
            return decode_verdict(record.value, record.headers)
        except SchemaError as exc:
            log.warning("undecodable verdict at %s:%d: %s", record.partition, record.offset, exc)
            return None

    async def _read_tokens(self, verdicts: list[GroupVerdict]) -> list[GroupVerdict]:
        """Referenced members' turns read back (a broker outage is retried with backoff)."""
        if not any(needs_tokens(v) for v in verdicts):
            return verdicts
        return await TOKENS_RETRY.run(lambda: self._tokens.resolve(verdicts), what="reading members' tokens back")

    def _on_verdict(self, verdict: GroupVerdict) -> None:
        if verdict.experiment_id != self.experiment:  # published to the wrong topic: not ours to hand out
            log.debug(
                "verdict of group %s of experiment %r on %s ignored (this waiter waits for %r)",
                verdict.group_id,
                verdict.experiment_id,
                self.topic,
                self.experiment,
            )
            return
        key = scoped_group(verdict.experiment_id, verdict.group_id)
        self.arrivals.setdefault(key, time.perf_counter())
        if self.keep is not None:
            verdict = self.keep(verdict)
        self.recent[key] = verdict
        self.recent.move_to_end(key)
        while len(self.recent) > self.keep_recent:
            self.recent.popitem(last=False)
        fut = self._waiting.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(verdict)


class BlockingVerdicts:
    """Verdicts by group id for synchronous callers (a trainer's advantage step).

    A :class:`VerdictWaiter` on a :class:`~infra.event_loop.LoopClient`, started on first
    use at the verdicts written ``lookback_s`` before then, so the verdicts of samples
    scored before the caller started are found too. Kept verdicts are slimmed (no token
    tree, no per-turn scorer results: the token rewards stay) and bounded by
    ``keep_recent`` groups.
    """

    def __init__(
        self, cfg: PipelineConfig, *, lookback_s: float = 3600.0, keep_recent: int = 4096, experiment: str | None = None
    ) -> None:
        self.cfg = cfg
        self.experiment = check_experiment_id(experiment or cfg.trainer.experiment)
        self.lookback_s = float(lookback_s)
        self.keep_recent = keep_recent
        self._bridge: LoopClient[VerdictWaiter] = LoopClient(self._start, "prm-verdicts", start_timeout=60)

    @staticmethod
    def _slim(verdict: GroupVerdict) -> GroupVerdict:
        sessions = [msgspec.structs.replace(s, turns=[], turn_results=[]) for s in verdict.sessions]
        return msgspec.structs.replace(verdict, sessions=sessions)

    async def _start(self) -> VerdictWaiter:
        waiter = VerdictWaiter(
            self.cfg,
            since=time.time() - self.lookback_s,
            keep_recent=self.keep_recent,
            keep=self._slim,
            experiment=self.experiment,
        )
        await waiter.start()
        return waiter

    def get(self, group_ids: Iterable[str], timeout_s: float) -> dict[str, GroupVerdict]:
        """The verdicts of ``group_ids`` that arrive within ``timeout_s`` (all waited for together)."""
        ids = list(dict.fromkeys(group_ids))

        async def gather(waiter: VerdictWaiter) -> dict[str, GroupVerdict]:
            found = await asyncio.gather(*(waiter.wait(g, timeout_s) for g in ids))
            return {g: v for g, v in zip(ids, found) if v is not None}

        return self._bridge.run(gather, timeout=timeout_s + 30)

    def close(self) -> None:
        self._bridge.close(timeout=30)


# --------------------------------------------------------------------------- the client
class RewardClient:
    """Publish trainer samples as trajectories and await their groups' verdicts.

    Args:
        cfg: the pipeline config (Kafka, topics; ``worker.group_timeout_s`` sets the
            default wait).
        verdict_timeout_s: how long :meth:`score` waits for a verdict; default the
            workers' ``group_timeout_s`` + 30 s, so a group missing members is rejected
            by the workers before the client gives up.
        decode: token ids -> text, to give scorers that read text (a judge) each turn's
            words; without it turns carry tokens only.
        experiment: the experiment scored (docs/fleet.md); default ``trainer.experiment``.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        verdict_timeout_s: float | None = None,
        decode: Callable[[np.ndarray], str] | None = None,
        experiment: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.experiment = check_experiment_id(experiment or cfg.trainer.experiment)
        self.verdict_timeout_s = float(
            verdict_timeout_s if verdict_timeout_s is not None else cfg.worker.group_timeout_s + 30
        )
        self.decode = decode
        self._publisher: TrajectoryPublisher | None = None
        self._waiter: VerdictWaiter | None = None
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        """Create the Kafka clients (idempotent; :meth:`score` calls it on first use).

        Raises :class:`infra.experiments.UnknownExperiment` for an experiment the registry
        does not declare: no worker reads its topic, so every score would wait out its timeout.
        """
        async with self._starting:
            if self._waiter is not None:
                return
            await declared_experiment(self.cfg, self.experiment)
            waiter = VerdictWaiter(self.cfg, experiment=self.experiment)
            await waiter.start()
            publisher = TrajectoryPublisher(self.cfg.kafka, self.cfg.topics, experiment=self.experiment)
            try:
                await publisher.start()
            except BaseException:
                await waiter.aclose()
                raise
            self._waiter, self._publisher = waiter, publisher

    async def aclose(self) -> None:
        if self._publisher is not None:
            await self._publisher.aclose()
            self._publisher = None
        if self._waiter is not None:
            await self._waiter.aclose()
            self._waiter = None

    async def __aenter__(self) -> RewardClient:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ samples -> trajectories
    def trajectory(
        self, sample: Sample, *, group_id: str, group_size: int, trajectory_id: str | None = None
    ) -> tuple[ReadyTrajectory, list[tuple[int, int]]]:
        """One sample as a concat-export trajectory, and its turns' spans on the response."""
        prompt = np.asarray(sample.prompt_ids, dtype=np.int32)
        response = np.asarray(sample.response_ids, dtype=np.int32)
        logprobs = None if sample.response_logprobs is None else np.asarray(sample.response_logprobs, np.float32)
        if logprobs is not None and len(logprobs) != len(response):
            raise ShapingInputError(f"response_logprobs has {len(logprobs)} values for {len(response)} response tokens")
        if sample.response_mask is not None and len(sample.response_mask) != len(response):
            raise ShapingInputError(
                f"response_mask has {len(sample.response_mask)} values for {len(response)} response tokens"
            )
        spans = turn_spans(sample.response_mask, len(response))
        trajectory_id = trajectory_id or f"{group_id}/{uuid.uuid4().hex}"
        history = [dict(m) for m in sample.messages]
        interactions: list[Interaction] = []
        previous_end = 0
        for k, (start, end) in enumerate(spans):
            if start > previous_end and self.decode is not None:  # tool / user tokens between two turns
                history.append({"role": "tool", "content": self.decode(response[previous_end:start])})
            answer = [{"role": "assistant", "content": self.decode(response[start:end])}] if self.decode else []
            last = k == len(spans) - 1
            interactions.append(
                Interaction(
                    interaction_id=f"t{k}",
                    parent_id=f"t{k - 1}" if k else None,
                    messages=list(history),
                    output_message_list=answer,
                    model_response=ModelResponse.from_arrays(
                        np.concatenate([prompt, response[:start]]),
                        response[start:end],
                        None if logprobs is None else logprobs[start:end],
                        "length" if last and sample.truncated else "stop",
                    ),
                )
            )
            history.extend(answer)
            previous_end = end
        trajectory = ReadyTrajectory(
            trajectory_id=trajectory_id,
            session_id=sample.session_id or trajectory_id,
            group_id=group_id,
            group_size=group_size,
            interactions=interactions,
            outcome_reward=float(sample.outcome_reward),
            is_eval=sample.is_eval,
            policy_version=sample.policy_version,
            created_at=time.time(),
        )
        return trajectory, spans

    # ------------------------------------------------------------------ publish and wait
    async def score(
        self, sample: Sample, *, group_id: str, group_size: int, timeout_s: float | None = None
    ) -> SampleReward:
        """Publish one member of ``group_id`` and wait for the group's verdict.

        Members of one group may be scored concurrently (from several calls, tasks or
        processes): each waits for the same verdict.
        """
        trajectory, spans = self.trajectory(sample, group_id=group_id, group_size=group_size)
        (reward,) = await self._publish_and_wait(group_id, [(trajectory, spans, len(sample.response_ids))], timeout_s)
        return reward

    async def score_group(
        self, samples: Sequence[Sample], *, group_id: str | None = None, timeout_s: float | None = None
    ) -> list[SampleReward]:
        """Publish ``samples`` as one whole group and wait for its verdict."""
        if not samples:
            raise ShapingInputError("score_group needs at least one sample")
        group_id = group_id or uuid.uuid4().hex
        built = [
            (*self.trajectory(s, group_id=group_id, group_size=len(samples)), len(s.response_ids)) for s in samples
        ]
        return await self._publish_and_wait(group_id, built, timeout_s)

    # ------------------------------------------------------------------ streamed sessions
    async def publish_turn(self, turn: SessionTurn) -> None:
        """Publish one turn of a streamed session as the agent produced it (docs/wire.md,
        "Streamed sessions"): its judge work starts when its next state arrives. Returns
        once the broker acknowledged it; the group's verdict is awaited with :meth:`verdict`."""
        await self._stream(turn)

    async def end_session(self, end: SessionEnd) -> None:
        """Publish the end of a streamed session (after its last turn); returns once acknowledged."""
        await self._stream(end)

    async def verdict(self, group_id: str, timeout_s: float | None = None) -> GroupVerdict | None:
        """The verdict of ``group_id`` (of this client's experiment), or None when none came in time."""
        await self.start()
        assert self._waiter is not None
        return await self._waiter.wait(group_id, self.verdict_timeout_s if timeout_s is None else timeout_s)

    async def _stream(self, message: SessionTurn | SessionEnd) -> None:
        await self.start()
        assert self._publisher is not None and self._waiter is not None
        self._waiter.expect(message.group_id)  # before publishing: the verdict cannot slip past us
        await self._publisher.publish(message)
        await self._publisher.flush()

    async def _publish_and_wait(
        self, group_id: str, built: list[tuple[ReadyTrajectory, list[tuple[int, int]], int]], timeout_s: float | None
    ) -> list[SampleReward]:
        await self.start()
        assert self._publisher is not None and self._waiter is not None
        self._waiter.expect(group_id)  # before publishing: the verdict cannot slip past us
        for trajectory, _, _ in built:
            await self._publisher.publish(trajectory)
        await self._publisher.flush()  # published before anyone is told it was accepted
        timeout = self.verdict_timeout_s if timeout_s is None else timeout_s
        verdict = await self._waiter.wait(group_id, timeout)
        return [rewards_for(verdict, t, spans, n, group_id=group_id, timeout_s=timeout) for t, spans, n in built]


def rewards_for(
    verdict: GroupVerdict | None,
    trajectory: ReadyTrajectory,
    spans: list[tuple[int, int]],
    response_len: int,
    *,
    group_id: str,
    timeout_s: float,
) -> SampleReward:
    """One sample's :class:`SampleReward` from its group's verdict (``None``: it never came)."""
    rewards = np.zeros(response_len, dtype=np.float32)
    if verdict is None:
        return SampleReward(
            group_id,
            trajectory.trajectory_id,
            "timeout",
            f"no verdict for group {group_id!r} within {timeout_s:g}s",
            trajectory.outcome_reward,
            rewards,
            [0.0] * len(spans),
            spans,
        )
    session = next((s for s in verdict.sessions if s.trajectory_id == trajectory.trajectory_id), None)
    outcome = trajectory.outcome_reward if session is None or session.outcome_reward is None else session.outcome_reward
    if verdict.status != "accepted":
        return SampleReward(
            group_id,
            trajectory.trajectory_id,
            verdict.status,
            verdict.reason,
            outcome,
            rewards,
            [0.0] * len(spans),
            spans,
            verdict,
            reason_code=verdict.reason_code,
        )
    if session is None:
        raise VerdictMismatch(f"accepted verdict of group {group_id!r} lacks member {trajectory.trajectory_id!r}")
    turns: list[float] = []
    per_turn = session_turn_rewards(session, group_id=group_id)
    if per_turn:  # none when the workers run with scoring off
        if len(per_turn) != len(spans):
            raise VerdictMismatch(f"group {group_id!r}: {len(per_turn)} turns scored for {len(spans)} turns sent")
        for k, ((start, end), values) in enumerate(zip(spans, per_turn)):
            if len(values) != end - start:
                raise VerdictMismatch(
                    f"group {group_id!r}: turn t{k} has {len(values)} rewards for {end - start} tokens"
                )
            rewards[start:end] = values
            turns.append(float(values.mean()) if len(values) else 0.0)
    else:
        turns = [0.0] * len(spans)
    return SampleReward(
        group_id,
        trajectory.trajectory_id,
        "accepted",
        verdict.reason,
        outcome,
        rewards,
        turns,
        spans,
        verdict,
        reason_code=verdict.reason_code,
    )


def session_turn_rewards(session: SessionResult, *, group_id: str) -> list[np.ndarray]:
    """Per-turn process token rewards of a session published by :class:`RewardClient` (turns ``t0``, ``t1``, …).

    Empty when the workers ran with scoring off (no branches).
    """
    if not session.branches:
        return []
    if len(session.branches) != 1:
        raise VerdictMismatch(
            f"group {group_id!r}: session {session.trajectory_id!r} has {len(session.branches)} "
            "branches; a sample is one chain of turns"
        )
    token_rewards = session.branches[0].token_rewards
    try:
        return [token_rewards[f"t{k}"].to_numpy() for k in range(len(token_rewards))]
    except KeyError as exc:
        raise VerdictMismatch(f"group {group_id!r}: session {session.trajectory_id!r} lacks turn {exc}") from None


ProcessReduction = Literal["mean", "sum", "last"]


def reduce_process(reward: SampleReward, how: ProcessReduction = "mean") -> float:
    """One scalar from a sample's process rewards, over the tokens the model generated.

    ``mean`` / ``sum`` / ``last`` (the last generated token's value); 0 for a sample that
    was not accepted or generated nothing. Trainers that take one number per sample (TRL's
    reward functions, OpenRLHF, slime) add it to the outcome.
    """
    if how not in ("mean", "sum", "last"):
        raise ConfigError(f"process reduction must be 'mean', 'sum' or 'last', got {how!r}")
    if not reward.accepted:
        return 0.0
    values = (
        np.concatenate([reward.token_rewards[s:e] for s, e in reward.turn_spans])
        if reward.turn_spans
        else reward.token_rewards
    )
    if not len(values):
        return 0.0
    return float(values.mean() if how == "mean" else values.sum() if how == "sum" else values[-1])
