"""verifiers integration: a ``vf.Task`` mixin whose reward posts the trace and writes per-turn rewards.

The only module of the project that imports ``verifiers`` (tested against verifiers
0.4.0, ``verifiers.v1``; see docs/integrations/verifiers.md). Mix
:class:`PRMRewardMixin` into a task::

    class MathTask(PRMRewardMixin, vf.Task):
        prm_config = "prm.yaml"

``Task.score`` then runs :meth:`PRMRewardMixin.prm_process` next to the task's own
rewards. It publishes the trace's branch as one sample — the tokens of every node, the
sampled (model) tokens as turns with their log-probs, tool and user tokens in between —
waits, bounded, for its group's verdict, and

* writes ``trace.info["turn_rewards"]``: one ``float | None`` per sampled turn (node),
  the mean process reward of its tokens — the field prime-rl's proposed ``turn_credit``
  reads; ``None`` for every turn when the group was not accepted;
* writes ``trace.info["prm"]``: status, reason, group id, outcome and the scalar;
* returns ``{"prm_process": <reduction of the process rewards>}`` — recorded as a
  weighted reward — only when the group was accepted. A timeout or a rejected group
  records no reward (``trace.rewards`` lacks ``prm_process`` and ``trace.info["prm"]``
  says why): never a silent 0.

Groups: by default each trace is its own group of one (the pipeline's scorers judge a
trace alone; group normalisation stays the trainer's). Override :meth:`prm_group` to
score a rollout group together (the workers then reject or accept it as a whole).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from asyncio import AbstractEventLoop, get_running_loop
from contextvars import ContextVar
from os import PathLike
from typing import Any, ClassVar

import numpy as np
import verifiers.v1 as vf
from verifiers.v1.types import content_text

from infra.config import PipelineConfig, load_config
from shaper.reward_client import ProcessReduction, RewardClient, Sample, SampleReward, reduce_process

log = logging.getLogger(__name__)

__all__ = ["PRMRewardMixin", "close_clients", "trace_sample"]

# One client per event loop and config: aiokafka's clients belong to the loop that made them.
_CLIENTS: weakref.WeakKeyDictionary[AbstractEventLoop, dict[Any, RewardClient]] = weakref.WeakKeyDictionary()
# The text of the trace being scored, per asyncio task: concurrent traces share a client.
_TEXTS: ContextVar[dict[tuple[int, ...], str]] = ContextVar("prm_trace_texts", default={})  # noqa: B039 - read-only


def _decode(ids: np.ndarray) -> str:
    return _TEXTS.get().get(tuple(int(i) for i in ids), "")


def _client(cfg: PipelineConfig | str | PathLike | None, timeout_s: float | None) -> RewardClient:
    loop = get_running_loop()
    key = (id(cfg) if isinstance(cfg, PipelineConfig) else cfg, timeout_s)
    clients = _CLIENTS.setdefault(loop, {})
    if key not in clients:
        config = cfg if isinstance(cfg, PipelineConfig) else load_config(None if cfg is None else str(cfg))
        clients[key] = RewardClient(config, verdict_timeout_s=timeout_s, decode=_decode)
    return clients[key]


async def close_clients() -> None:
    """Stop this event loop's pipeline clients (at the end of a run; scoring restarts them)."""
    for client in _CLIENTS.pop(get_running_loop(), {}).values():
        await client.aclose()


def _text(message: Any) -> str:
    return content_text(getattr(message, "content", None)) or ""


def trace_sample(trace: Any, *, outcome: float = 0.0) -> tuple[Sample, list[list[int]], dict[tuple[int, ...], str]]:
    """The trace's branch as a :class:`Sample`, each sampled node's response positions, and the turns' text.

    The prompt is every token before the first sampled one; the response is the rest,
    with ``response_mask`` = verifiers' sampled mask. The text map gives the pipeline
    each turn's words (and the tool / user text between turns) for scorers that read text.
    """
    branches = trace.branches
    if len(branches) != 1:
        raise ValueError(f"trace {trace.id} has {len(branches)} branches; the PRM reward scores single-branch traces")
    (branch,) = branches
    ids = np.asarray(branch.token_ids, dtype=np.int64)
    mask = np.asarray(branch.sampled_mask, dtype=bool)
    if not mask.any():
        raise ValueError(f"trace {trace.id} has no sampled tokens (no token ids recorded?)")
    start = int(np.argmax(mask))
    positions: list[list[int]] = []  # per sampled node: its sampled tokens' positions in the response
    owner = np.full(len(ids), -1)  # node index (in branch.nodes) of every token
    prompt_messages: list[dict[str, Any]] = []
    offset = 0
    for k, node in enumerate(branch.nodes):
        n = len(node.token_ids)
        owner[offset:offset + n] = k
        if node.sampled:
            positions.append([offset + i - start for i, m in enumerate(node.mask) if m])
        elif offset + n <= start:
            prompt_messages.append({"role": node.message.role, "content": _text(node.message)})
        offset += n
    response_mask = mask[start:].astype(np.int8)
    texts: dict[tuple[int, ...], str] = {}
    response = ids[start:]
    edges = np.flatnonzero(np.diff(np.concatenate(([0], response_mask, [0]))))
    previous = 0
    for s, e in zip(edges[::2], edges[1::2]):  # each run of sampled tokens, and the gap before it
        for lo, hi, model_turn in ((previous, s, False), (s, e, True)):  # a turn's scaffold is not its text
            if hi > lo:
                nodes = sorted({int(k) for k in owner[start + lo:start + hi]})
                texts[tuple(response[lo:hi].tolist())] = "".join(
                    _text(branch.nodes[k].message) for k in nodes if branch.nodes[k].sampled == model_turn)
        previous = e
    sample = Sample(prompt_ids=ids[:start], response_ids=response, response_logprobs=np.asarray(branch.logprobs[start:]),
                    response_mask=response_mask, outcome_reward=float(outcome), messages=prompt_messages,
                    truncated=bool(trace.is_truncated), session_id=str(trace.id))
    return sample, positions, texts


class PRMRewardMixin:
    """Adds the ``prm_process`` reward to a ``vf.Task`` (put it before ``vf.Task`` in the bases).

    Class attributes: ``prm_config`` (a :class:`PipelineConfig` or YAML path; ``None``:
    ``$PRM_CONFIG``), ``prm_reduction`` (``mean`` / ``sum`` / ``last`` of the generated
    tokens' process rewards, the returned scalar), ``prm_verdict_timeout_s`` (default
    the workers' ``group_timeout_s`` + 30 s), ``prm_on_timeout`` (``record`` — note it
    in ``trace.info["prm"]`` — or ``raise``: the task's scoring fails with a ``vf.TaskError`` naming the group). The reward's
    weight is 1; a task config's ``rewards.prm_process`` entry overrides it.
    """

    prm_config: ClassVar[PipelineConfig | str | PathLike | None] = None
    prm_reduction: ClassVar[ProcessReduction] = "mean"
    prm_verdict_timeout_s: ClassVar[float | None] = None
    prm_on_timeout: ClassVar[str] = "record"

    def prm_group(self, task: Any, trace: Any) -> tuple[str, int]:
        """``(group id, group size)`` for this trace; default: a group of its own."""
        return f"vf-{trace.id}", 1

    def prm_outcome(self, task: Any, trace: Any) -> float:
        """The outcome sent with the trace (scorers and group filters see it); default 0.
        May be ``async``. Other rewards run concurrently, so compute it here, not from them."""
        return 0.0

    @vf.reward
    async def prm_process(self, task: Any, trace: Any) -> dict[str, float]:
        outcome = self.prm_outcome(task, trace)
        if inspect.isawaitable(outcome):
            outcome = await outcome
        sample, positions, texts = trace_sample(trace, outcome=float(outcome))
        group_id, group_size = self.prm_group(task, trace)
        client = _client(self.prm_config, self.prm_verdict_timeout_s)
        _TEXTS.set(texts)
        reward: SampleReward = await client.score(sample, group_id=group_id, group_size=group_size)
        scalar = reduce_process(reward, self.prm_reduction)
        trace.info["prm"] = {"status": reward.status, "reason": reward.reason, "group_id": reward.group_id,
                             "outcome": reward.outcome, "process": scalar if reward.accepted else None}
        if not reward.accepted:
            trace.info["turn_rewards"] = [None] * len(positions)
            if reward.status == "timeout" and self.prm_on_timeout == "raise":
                raise vf.TaskError(f"prm_process: {reward.reason}")  # typed: verifiers keeps the message
            log.warning("prm: trace %s: %s (%s); no process reward recorded", trace.id, reward.status, reward.reason)
            return {}
        trace.info["turn_rewards"] = [float(reward.token_rewards[p].mean()) if p else None for p in positions]
        return {"prm_process": scalar}
