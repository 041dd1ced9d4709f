"""A real rollout proxy: the tiny policy talks to a small environment, sessions go to Kafka.

The toy task ("show me numbers", multi-turn): each prompt is a small arithmetic
request, and every assistant turn is checked the same way — it **passes** when it
shows an expression ``a op b`` (a **calculator tool** answers ``result: V (success)``)
or at least :attr:`Environment.DIGITS` digits (the **user simulator** answers ``thanks,
ok - go on``); otherwise the user answers ``wrong, show me more numbers``. The text is
nonsense (the policy is a random tiny LM); the structure is what real agents export:

* **concat export** — turn ``k+1``'s input ids are turn ``k``'s input ids + its output
  ids + the template's ids for the new tool/user message (never re-tokenised text);
* **groups** — ``group_size`` sessions per prompt (GRPO), each with its own sampling;
* **branching** — every ``branch_every``-th session samples its second turn twice from
  the same input: two leaves sharing the first turn;
* ``policy_version`` is the version of the weights that produced every token;
  :meth:`RolloutProxy.reload` picks up weights the trainer published;
* **streamed** — :meth:`RolloutProxy.stream_group` publishes each turn as a ``turn``
  record as soon as it is sampled and the environment has answered it (its next state
  is then known), and each session's ``end`` with the outcome once its last turn is
  out, as a deployed agent's proxy would (docs/wire.md, "Streamed sessions"): the
  workers judge turns while the rest of the session is still being sampled.

The outcome reward is **sparse**: 1 only when *every* turn of the session's main branch
passed, else 0 — it says that something went wrong, not where. The environment's
answers say where: a judge reading the next state (the OpenClaw-RL PRM judge) marks
each answered turn ``+1`` or ``-1``. A random model passes about half its turns, so a
3-turn session succeeds about one time in eight and most GRPO groups are all-zero:
outcome-only GRPO learns nothing from them, the per-turn judge still does.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from infra.schema import Interaction, ModelResponse, ReadyTrajectory, SessionEnd, SessionTurn, stream_session
from producers.publisher import TrajectoryPublisher

from .tiny_model import TinyPolicy, WeightStore

__all__ = ["Environment", "RolloutConfig", "RolloutProxy", "RolloutStats"]

_EXPR = re.compile(r"(\d+)\s*([+\-*])\s*(\d+)")
_DIGIT = re.compile(r"\d")


class Environment:
    """The calculator tool and the user simulator; :meth:`passes` is the per-turn check."""

    DIGITS = 6  # about half of the random tiny LM's turns reach it

    @classmethod
    def passes(cls, output_text: str) -> bool:
        """A turn passes with an expression to evaluate or at least :attr:`DIGITS` digits."""
        return _EXPR.search(output_text) is not None or len(_DIGIT.findall(output_text)) >= cls.DIGITS

    def respond(self, turn: int, output_text: str) -> dict[str, str]:
        found = _EXPR.search(output_text)
        if found is not None:
            a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
            value = a + b if op == "+" else a - b if op == "-" else a * b
            return {"role": "tool", "content": f"result: {value} (success)"}
        if self.passes(output_text):
            return {"role": "user", "content": "thanks, ok - go on"}
        return {"role": "user", "content": "wrong, show me more numbers"}

    @classmethod
    def outcome(cls, turn_texts: Sequence[str]) -> float:
        """1.0 when every turn of the main branch passed, else 0.0 (sparse on purpose)."""
        return 1.0 if turn_texts and all(cls.passes(t) for t in turn_texts) else 0.0


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    group_size: int = 4
    max_turns: int = 3  # sessions have min_turns..max_turns turns on their main branch
    min_turns: int = 1
    max_new_tokens: tuple[int, int] = (6, 16)  # each turn's token limit is drawn from this range
    branch_every: int = 3  # session i branches when i % branch_every == branch_every - 1
    seed: int = 0


@dataclass(slots=True)
class RolloutStats:
    sessions: int = 0
    turns: int = 0
    tokens: int = 0
    seconds: float = 0.0
    outcomes: list[float] = field(default_factory=list)
    ended: dict[str, float] = field(default_factory=dict)
    """session id -> ``time.perf_counter()`` when the broker acknowledged its streamed ``end``."""


class RolloutProxy:
    """Samples sessions with :class:`TinyPolicy` and publishes them with :class:`TrajectoryPublisher`."""

    def __init__(
        self,
        policy: TinyPolicy,
        config: RolloutConfig | None = None,
        *,
        store: WeightStore | None = None,
        env: Environment | None = None,
    ) -> None:
        self.policy = policy
        self.config = config or RolloutConfig()
        self.store = store
        self.env = env or Environment()
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.rng = np.random.default_rng(self.config.seed)
        self.stats = RolloutStats()

    def reload(self) -> bool:
        """Load newer published weights (bumps ``policy.version``); True if it did."""
        return self.store is not None and self.store.reload(self.policy)

    def _turn(
        self,
        iid: str,
        parent: str | None,
        input_ids: list[int],
        messages: list[dict[str, str]],
    ) -> tuple[Interaction, str, bool]:
        lo, hi = self.config.max_new_tokens
        sample = self.policy.sample(input_ids, int(self.rng.integers(lo, hi + 1)), self.generator)
        text = self.policy.template.decode([t for t in sample.tokens if t > 2])  # specials are structure
        answer = {"role": "assistant", "content": text}
        self.stats.turns += 1
        self.stats.tokens += len(sample.tokens)
        inter = Interaction(
            interaction_id=iid,
            parent_id=parent,
            messages=list(messages),
            output_message_list=[answer],
            model_response=ModelResponse.from_arrays(
                np.asarray(input_ids, np.int32),
                np.asarray(sample.tokens, np.int32),
                np.asarray(sample.logprobs, np.float32),
                sample.stop_reason,
            ),
        )
        return inter, text, sample.stop_reason == "stop"

    def session(
        self, group_id: str, index: int, task: str, *, turns: int | None = None, branch: bool | None = None
    ) -> ReadyTrajectory:
        """One session of ``turns`` turns (drawn when None); ``branch`` forks its second turn."""
        return _drain(self._session(group_id, index, task, turns=turns, branch=branch))

    def _session(
        self, group_id: str, index: int, task: str, *, turns: int | None = None, branch: bool | None = None
    ) -> Generator[Interaction, None, ReadyTrajectory]:
        """:meth:`session`, yielding each turn as soon as its next state is known (the
        environment answered it, or it is a leaf) and returning the whole session.

        The one sampling path of both forms: a streamed session draws exactly what the
        ready one draws, so a seed gives the same rollouts either way."""
        cfg = self.config
        n = int(turns if turns is not None else self.rng.integers(cfg.min_turns, cfg.max_turns + 1))
        branch = (index % cfg.branch_every == cfg.branch_every - 1 and n >= 2) if branch is None else branch
        member = self._member(group_id, index)
        sid = member["session_id"]
        messages = [{"role": "system", "content": "use the calculator"}, {"role": "user", "content": task}]
        ids = self.policy.template.render(messages)
        interactions: list[Interaction] = []
        parent: str | None = None
        text = ""
        texts: list[str] = []
        fork: tuple[list[int], list[dict[str, str]], str | None] | None = None
        for k in range(n):
            if branch and k == 1:
                fork = (list(ids), list(messages), parent)
            inter, text, ended = self._turn(f"{sid}-t{k}", parent, ids, messages)
            interactions.append(inter)
            texts.append(text)
            parent = inter.interaction_id
            if k + 1 < n:  # the environment answers; the next input extends this one (concat)
                reply = self.env.respond(k, text)
                assert inter.model_response is not None  # _turn always fills it
                ids = [
                    *ids,
                    *inter.model_response.output_tokens.tolist(),
                    *self.policy.template.continuation(ended, [reply]),
                ]
                messages = [*messages, *inter.output_message_list, reply]
            yield inter  # answered, or the main branch's leaf: nothing more will follow it
        if fork is not None:  # a second leaf from the second turn's input: its parent is out already
            inter, _, _ = self._turn(f"{sid}-t1b", fork[2], fork[0], fork[1])
            interactions.append(inter)
            yield inter
        self.stats.sessions += 1
        outcome = self.env.outcome(texts)
        self.stats.outcomes.append(outcome)
        return ReadyTrajectory(
            **member,
            interactions=interactions,
            outcome_reward=outcome,
            policy_version=self.policy.version,
            created_at=time.time(),
        )

    def group(self, group_id: str, task: str | None = None) -> list[ReadyTrajectory]:
        """``group_size`` sessions of one prompt."""
        t0 = time.perf_counter()
        task = self._task() if task is None else task
        members = [self.session(group_id, i, task) for i in range(self.config.group_size)]
        self.stats.seconds += time.perf_counter() - t0
        return members

    async def stream_group(
        self, publisher: TrajectoryPublisher, group_id: str, task: str | None = None
    ) -> list[ReadyTrajectory]:
        """The sessions :meth:`group` would sample, each published as it is sampled (:meth:`stream_session`)."""
        t0 = time.perf_counter()
        task = self._task() if task is None else task
        members = [await self.stream_session(publisher, group_id, i, task) for i in range(self.config.group_size)]
        self.stats.seconds += time.perf_counter() - t0
        return members

    async def stream_session(
        self, publisher: TrajectoryPublisher, group_id: str, index: int, task: str
    ) -> ReadyTrajectory:
        """The session :meth:`session` would sample, published while it is sampled: each
        turn a ``turn`` record as soon as the environment answered it, then the ``end``
        with the outcome, flushed (acknowledged by the broker: the moment noted in
        ``stats.ended``). Returns the session in its ready form (what the verdict scores).

        The sampling runs in a worker thread, one step at a time, so the event loop sends
        each turn at once and keeps consuming verdicts meanwhile."""
        steps = self._session(group_id, index, task)
        member = self._member(group_id, index)
        while not isinstance(step := await asyncio.to_thread(_advance, steps), ReadyTrajectory):
            await publisher.publish_turn(SessionTurn(interaction=step, **member))
        await publisher.end_session(
            SessionEnd(
                outcome_reward=step.outcome_reward,
                policy_version=step.policy_version,
                turn_count=len(step.interactions),
                **member,
            )
        )
        await publisher.flush()
        self.stats.ended[step.session_id] = time.perf_counter()
        return step

    async def publish(self, publisher: TrajectoryPublisher, members: Sequence[ReadyTrajectory]) -> int:
        """Publish sessions held whole (sampled by :meth:`group` or :meth:`session`, maybe
        altered) as streamed sessions, turns then end (:func:`infra.schema.stream_session`),
        and flush; returns the records sent."""
        n = 0
        for traj in members:
            turns, end = stream_session(traj)
            n += await publisher.publish_many([*turns, end])
        await publisher.flush()
        return n

    def _task(self) -> str:
        a, b = (int(x) for x in self.rng.integers(0, 50, 2))
        return f"compute {a} + {b}"

    def _member(self, group_id: str, index: int) -> dict[str, Any]:
        """Session ``index`` of ``group_id``'s identity: the same on its ready record and every streamed one."""
        return {
            "trajectory_id": f"{group_id}-traj{index}",
            "session_id": f"{group_id}-s{index}",
            "group_id": group_id,
            "group_size": self.config.group_size,
        }


def _advance(steps: Generator[Interaction, None, ReadyTrajectory]) -> Interaction | ReadyTrajectory:
    """The next turn of a session being sampled, or the whole session once it is done
    (a ``StopIteration`` cannot cross :func:`asyncio.to_thread`)."""
    try:
        return next(steps)
    except StopIteration as done:
        return done.value


def _drain(steps: Generator[Interaction, None, ReadyTrajectory]) -> ReadyTrajectory:
    while not isinstance(step := _advance(steps), ReadyTrajectory):
        pass
    return step
