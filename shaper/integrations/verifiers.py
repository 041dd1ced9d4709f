"""verifiers (0.4.0, ``verifiers.v1``; docs/integrations/verifiers.md; the only module importing it): a task mixin.

Mix :class:`PRMRewardMixin` into a task::

    class MathTask(PRMRewardMixin, vf.Task):
        prm_config = "prm.yaml"

``Task.score`` then runs :meth:`PRMRewardMixin.prm_process` next to the task's own
rewards. It publishes the trace's branch as one sample — the tokens of every node, the
sampled (model) tokens as turns with their log-probs, tool and user tokens in between —
waits, bounded, for its group's verdict, and

* writes ``trace.info["turn_rewards"]``: per sampled turn (node) the mean process reward of
  its tokens (prime-rl's proposed ``turn_credit``); ``None`` each when not accepted;
* writes ``trace.info["prm"]``: status, reason code, reason, group id, outcome and the scalar;
* returns ``{"prm_process": <reduction of the process rewards>}`` only when the group was
  accepted: a late or rejected group records no reward (``trace.info["prm"]`` says why).

Groups: each trace is its own group of one unless :meth:`prm_group` says otherwise. The
timeout policy (``outcome_only`` or ``raise``) is :mod:`shaper.integrations.core`'s.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, ClassVar

import numpy as np
import verifiers.v1 as vf
from verifiers.v1.types import content_text

from infra.config import PipelineConfig
from shaper.integrations import core
from shaper.reward_client import ProcessReduction, RewardClient, Sample, SampleReward, reduce_process, turn_spans

__all__ = ["PRMRewardMixin", "close_clients", "trace_sample"]

_CLIENTS: core.PerLoop[RewardClient] = core.PerLoop()  # per event loop, config and wait
# The text of the trace being scored, per asyncio task: concurrent traces share a client.
_TEXTS: ContextVar[dict[tuple[int, ...], str]] = ContextVar("prm_trace_texts", default={})  # noqa: B039 - read-only


def _decode(ids: np.ndarray) -> str:
    return _TEXTS.get().get(tuple(int(i) for i in ids), "")


async def close_clients() -> None:
    """Stop this event loop's pipeline clients (at the end of a run; scoring restarts them)."""
    await _CLIENTS.aclose()


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
        raise core.ShapingInputError(
            f"trace {trace.id} has {len(branches)} branches; the PRM reward scores single-branch traces"
        )
    (branch,) = branches
    ids = np.asarray(branch.token_ids, dtype=np.int64)
    mask = np.asarray(branch.sampled_mask, dtype=bool)
    if not mask.any():
        raise core.ShapingInputError(f"trace {trace.id} has no sampled tokens (no token ids recorded?)")
    start = int(np.argmax(mask))
    positions: list[list[int]] = []  # per sampled node: its sampled tokens' positions in the response
    owner = np.full(len(ids), -1)  # node index (in branch.nodes) of every token
    prompt_messages: list[dict[str, Any]] = []
    offset = 0
    for k, node in enumerate(branch.nodes):
        n = len(node.token_ids)
        owner[offset : offset + n] = k
        if node.sampled:
            positions.append([offset + i - start for i, m in enumerate(node.mask) if m])
        elif offset + n <= start:
            prompt_messages.append({"role": node.message.role, "content": _text(node.message)})
        offset += n
    response_mask = mask[start:].astype(np.int8)
    texts: dict[tuple[int, ...], str] = {}
    response = ids[start:]
    previous = 0
    for s, e in turn_spans(response_mask, len(response)):  # each run of sampled tokens, and the gap before it
        for lo, hi, model_turn in ((previous, s, False), (s, e, True)):  # a turn's scaffold is not its text
            if hi > lo:
                nodes = sorted({int(k) for k in owner[start + lo : start + hi]})
                texts[tuple(response[lo:hi].tolist())] = "".join(
                    _text(branch.nodes[k].message) for k in nodes if branch.nodes[k].sampled == model_turn
                )
        previous = e
    logprobs = np.asarray(branch.logprobs[start:])
    sample = Sample(
        prompt_ids=ids[:start],
        response_ids=response,
        response_logprobs=logprobs,
        response_mask=response_mask,
        outcome_reward=float(outcome),
        messages=prompt_messages,
        truncated=bool(trace.is_truncated),
        session_id=str(trace.id),
    )
    return sample, positions, texts


class PRMRewardMixin:
    """Adds the ``prm_process`` reward to a ``vf.Task`` (put it before ``vf.Task`` in the bases).

    Class attributes: ``prm_config`` (a :class:`PipelineConfig` or YAML path; ``None``:
    ``$PRM_CONFIG``), ``prm_reduction`` (``mean`` / ``sum`` / ``last``: the returned scalar),
    ``prm_verdict_timeout_s`` (default the workers' ``group_timeout_s`` + 30 s),
    ``prm_on_timeout`` (``outcome_only``: note it in ``trace.info["prm"]``, or ``raise``: the
    task's scoring fails with a ``vf.TaskError`` naming the group; ``record`` is a deprecated
    name for ``outcome_only``). The reward's weight is 1; ``rewards.prm_process`` overrides it.
    """

    prm_config: ClassVar[core.ConfigArg] = None
    prm_reduction: ClassVar[ProcessReduction] = "mean"
    prm_verdict_timeout_s: ClassVar[float | None] = None
    prm_on_timeout: ClassVar[str] = "outcome_only"

    def prm_group(self, task: Any, trace: Any) -> tuple[str, int]:
        """``(group id, group size)`` for this trace; default: a group of its own."""
        return f"vf-{trace.id}", 1

    def prm_outcome(self, task: Any, trace: Any) -> float:
        """The outcome sent with the trace (scorers and group filters see it); default 0.
        May be ``async``. Other rewards run concurrently, so compute it here, not from them."""
        return 0.0

    @vf.reward
    async def prm_process(self, task: Any, trace: Any) -> dict[str, float]:
        settings = core.AdapterSettings.checked(
            on_timeout=self.prm_on_timeout,
            reduction=self.prm_reduction,
            verdict_timeout_s=self.prm_verdict_timeout_s,
            supports=("outcome_only", "raise"),
            key="prm_on_timeout",
        )
        outcome = float(await core.resolved(self.prm_outcome(task, trace)))
        sample, positions, texts = trace_sample(trace, outcome=outcome)
        group_id, group_size = self.prm_group(task, trace)
        cfg = self.prm_config
        client = _CLIENTS.get(
            (id(cfg) if isinstance(cfg, PipelineConfig) else cfg, settings.verdict_timeout_s),
            lambda: settings.client(core.load_pipeline(cfg), _decode),
        )
        _TEXTS.set(texts)
        reward: SampleReward = await client.score(sample, group_id=group_id, group_size=group_size)
        scalar = reduce_process(reward, settings.reduction)
        trace.info["prm"] = {
            "status": reward.status,
            "reason_code": reward.reason_code,
            "reason": reward.reason,
            "group_id": reward.group_id,
            "outcome": reward.outcome,
            "process": scalar if reward.accepted else None,
        }
        if not reward.accepted:
            trace.info["turn_rewards"] = [None] * len(positions)
            try:
                core.settle([reward], settings, who=f"prm: trace {trace.id}")
            except core.VerdictTimeout as exc:
                raise vf.TaskError(f"prm_process: {exc}") from exc  # typed: verifiers keeps the message
            return {}
        trace.info["turn_rewards"] = [float(reward.token_rewards[p].mean()) if p else None for p in positions]
        return {"prm_process": scalar}
