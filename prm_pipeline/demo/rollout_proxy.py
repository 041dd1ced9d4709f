"""A real rollout proxy: the tiny policy talks to a small environment, sessions go to Kafka.

Each prompt is a small arithmetic task. A session alternates policy turns with
environment answers — a **calculator tool** (it evaluates the first ``a op b`` it finds
in the assistant's text, or answers ``error: ...``) and a **user simulator** (``thanks,
ok`` when the answer shows six digits or more, ``wrong, ...`` otherwise). The text is nonsense
(the policy is a random tiny LM); the structure is what real agents export:

* **concat export** — turn ``k+1``'s input ids are turn ``k``'s input ids + its output
  ids + the template's ids for the new tool/user message (never re-tokenised text);
* **groups** — ``group_size`` sessions per prompt (GRPO), each with its own sampling;
* **branching** — every ``branch_every``-th session samples its second turn twice from
  the same input: two leaves sharing the first turn;
* ``policy_version`` is the version of the weights that produced every token;
  :meth:`RolloutProxy.reload` picks up weights the trainer published.

The outcome reward is 1 when the session's last answer contains at least six digits
(something a policy can learn; about half of the random model's answers do), else 0.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from infra.schema import Interaction, ModelResponse, ReadyTrajectory
from producers.publisher import TrajectoryPublisher

from .tiny_model import TinyPolicy, WeightStore

__all__ = ["Environment", "RolloutConfig", "RolloutProxy", "RolloutStats"]

_EXPR = re.compile(r"(\d+)\s*([+\-*])\s*(\d+)")
_DIGIT = re.compile(r"\d")


class Environment:
    """The calculator tool (even turns) and the user simulator (odd turns)."""

    def respond(self, turn: int, output_text: str) -> dict[str, str]:
        if turn % 2 == 0:
            found = _EXPR.search(output_text)
            if found is None:
                return {"role": "tool", "content": "error: no expression to evaluate"}
            a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
            value = a + b if op == "+" else a - b if op == "-" else a * b
            return {"role": "tool", "content": f"result: {value} (success)"}
        if len(_DIGIT.findall(output_text)) >= self.DIGITS:
            return {"role": "user", "content": "thanks, ok - go on"}
        return {"role": "user", "content": "wrong, show me more numbers"}

    DIGITS = 6  # about half of the random tiny LM's answers reach it: mixed GRPO groups

    @classmethod
    def outcome(cls, final_text: str) -> float:
        return 1.0 if len(_DIGIT.findall(final_text)) >= cls.DIGITS else 0.0


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    group_size: int = 4
    max_turns: int = 3  # sessions have 1..max_turns turns on their main branch
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


class RolloutProxy:
    """Samples sessions with :class:`TinyPolicy` and publishes them with :class:`TrajectoryPublisher`."""

    def __init__(self, policy: TinyPolicy, config: RolloutConfig | None = None, *,
                 store: WeightStore | None = None, env: Environment | None = None) -> None:
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

    def _turn(self, iid: str, parent: str | None, input_ids: list[int], messages: list[dict[str, str]],
              ) -> tuple[Interaction, str, bool]:
        lo, hi = self.config.max_new_tokens
        sample = self.policy.sample(input_ids, int(self.rng.integers(lo, hi + 1)), self.generator)
        text = self.policy.template.decode(t for t in sample.tokens if t > 2)  # specials are structure
        answer = {"role": "assistant", "content": text}
        self.stats.turns += 1
        self.stats.tokens += len(sample.tokens)
        inter = Interaction(
            interaction_id=iid, parent_id=parent, messages=list(messages), output_message_list=[answer],
            model_response=ModelResponse.from_arrays(np.asarray(input_ids, np.int32),
                                                     np.asarray(sample.tokens, np.int32),
                                                     np.asarray(sample.logprobs, np.float32), sample.stop_reason),
        )
        return inter, text, sample.stop_reason == "stop"

    def session(self, group_id: str, index: int, task: str, *, turns: int | None = None,
                branch: bool | None = None) -> ReadyTrajectory:
        """One session of ``turns`` turns (drawn when None); ``branch`` forks its second turn."""
        cfg = self.config
        n = int(turns if turns is not None else self.rng.integers(1, cfg.max_turns + 1))
        branch = (index % cfg.branch_every == cfg.branch_every - 1 and n >= 2) if branch is None else branch
        sid = f"{group_id}-s{index}"
        messages = [{"role": "system", "content": "use the calculator"}, {"role": "user", "content": task}]
        ids = self.policy.template.render(messages)
        interactions: list[Interaction] = []
        parent: str | None = None
        text = ""
        fork: tuple[list[int], list[dict[str, str]], str | None] | None = None
        for k in range(n):
            if branch and k == 1:
                fork = (list(ids), list(messages), parent)
            inter, text, ended = self._turn(f"{sid}-t{k}", parent, ids, messages)
            interactions.append(inter)
            parent = inter.interaction_id
            if k + 1 < n:  # the environment answers; the next input extends this one (concat)
                reply = self.env.respond(k, text)
                ids = [*ids, *inter.model_response.output_tokens.tolist(),
                       *self.policy.template.continuation(ended, [reply])]
                messages = [*messages, *inter.output_message_list, reply]
        if fork is not None:
            inter, _, _ = self._turn(f"{sid}-t1b", fork[2], fork[0], fork[1])
            interactions.append(inter)
        self.stats.sessions += 1
        outcome = self.env.outcome(text)
        self.stats.outcomes.append(outcome)
        return ReadyTrajectory(
            trajectory_id=f"{group_id}-traj{index}", session_id=sid, group_id=group_id,
            group_size=cfg.group_size, interactions=interactions, outcome_reward=outcome,
            policy_version=self.policy.version, created_at=time.time(),
        )

    def group(self, group_id: str, task: str | None = None) -> list[ReadyTrajectory]:
        """``group_size`` sessions of one prompt."""
        t0 = time.perf_counter()
        if task is None:
            a, b = (int(x) for x in self.rng.integers(0, 50, 2))
            task = f"compute {a} + {b}"
        members = [self.session(group_id, i, task) for i in range(self.config.group_size)]
        self.stats.seconds += time.perf_counter() - t0
        return members

    async def publish(self, publisher: TrajectoryPublisher, groups: Sequence[Sequence[ReadyTrajectory]]) -> int:
        n = 0
        for members in groups:
            n += await publisher.publish_many(members)
        await publisher.flush()
        return n
