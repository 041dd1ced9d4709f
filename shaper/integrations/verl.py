"""verl integration: a Reward Loop manager that scores through the pipeline, and ``prm_grpo``.

The only module of the project that imports ``verl`` (tested against verl 0.9.1; see
docs/integrations/verl.md). Importing it registers two names with verl:

* reward manager ``prm_pipeline`` (:class:`PRMRewardManager`, verl's Reward Loop
  ``register(name)`` / ``async run_single(data)``). For every sample verl hands over it
  computes verl's own outcome score (it *is* verl's ``naive`` manager for that part),
  publishes the sample as a :class:`~infra.schema.ReadyTrajectory` (group = verl's
  ``uid``, group size = ``rollout.n``, one turn per run of ``response_mask`` ones), waits —
  bounded — for its group's verdict, and returns the outcome plus the process token
  rewards aligned to the response tokens. A verdict that does not come in time is
  reported (``prm_status=timeout``, a warning, a counter), never turned into a zero.
* advantage estimator ``prm_grpo`` (:func:`compute_prm_grpo_advantage`): verl's GRPO on
  the outcome, then :func:`shaper.shaping.shape_advantages` with the configured mode.

Three facts of verl's interfaces shape this module (docs/integrations/verl.md says more):

1. A custom advantage estimator receives one per-token reward tensor
   (``token_level_rewards``), ``response_mask``, the ``uid`` index and the algorithm
   config — nothing else. Outcome and process rewards therefore travel in that one
   tensor, and must be separable: the outcome sits where verl's managers put it (the
   last response token), and the process reward of the **last generated token** is not
   carried (its slot holds the outcome). Every other generated token carries its own.
2. verl's response tensors are already indexed by the generated token
   (``old_log_probs[:, t]`` is log p(``responses[:, t]``)), which is the layout AReaL's
   roll(−1) produces from full sequences. :func:`shaper.shaping.shift_token_rewards`
   is therefore the identity here and is not applied; applying it would credit every
   reward to the token before.
3. The per-token ``rm_scores`` come from ``assemble_rm_scores(data, scores)``, a class
   method that sees only the ``reward_score`` values; and verl's streaming agent loop
   requires that value to be a float. :class:`PRMScore` is both: a float (the outcome)
   that carries the sample's process rewards.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
from verl.trainer.ppo import core_algos

from infra.config import PipelineConfig, PRMAdvantageShapingConfig, load_config
from infra.kafka import make_consumer, partitions_of
from infra.schema import GroupVerdict, Interaction, ModelResponse, ReadyTrajectory, SchemaError, decode_verdict
from producers.publisher import TrajectoryPublisher
from shaper.shaping import shape_advantages

log = logging.getLogger(__name__)

MANAGER_NAME = "prm_pipeline"
ESTIMATOR_NAME = "prm_grpo"

__all__ = [
    "ESTIMATOR_NAME", "MANAGER_NAME", "PRMRewardManager", "PRMScore", "VerdictTimeout", "VerdictWaiter",
    "compute_prm_grpo_advantage", "split_rewards", "turn_spans",
]


class VerdictTimeout(TimeoutError):
    """A group's verdict did not arrive within ``verdict_timeout_s`` (raised with ``on_timeout: raise``)."""


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b`` for verl's DictConfig / dataclass configs and plain dicts alike."""
    node = config
    for key in dotted.split("."):
        if node is None:
            return default
        node = node.get(key) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, key, None)
    return default if node is None else node


# --------------------------------------------------------------------------- samples <-> trajectories
def turn_spans(response_mask: np.ndarray | None, valid_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each generated turn inside a sample's valid response.

    verl's agent loop marks generated tokens with ``response_mask == 1`` and tool or
    user tokens with 0; each maximal run of ones is one model turn. Without a mask the
    whole response is one turn.
    """
    if response_mask is None:
        return [(0, valid_len)]
    mask = np.asarray(response_mask[:valid_len]).astype(bool)
    if not mask.any():
        return [(0, 0)]
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2])]


class PRMScore(float):
    """verl's ``reward_score`` (the outcome) carrying the sample's process token rewards.

    ``token_rewards`` (float32, one per valid response token, 0 on tool tokens) and
    ``status`` survive Ray's pickling; code that only wants a float sees the outcome.
    """

    token_rewards: np.ndarray
    status: str

    def __new__(cls, outcome: float, token_rewards: np.ndarray, status: str) -> PRMScore:
        obj = super().__new__(cls, outcome)
        obj.token_rewards = np.asarray(token_rewards, dtype=np.float32)
        obj.status = status
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (PRMScore, (float(self), self.token_rewards, self.status))


# --------------------------------------------------------------------------- verdicts
class VerdictWaiter:
    """Waits for groups' verdicts on ``prm.verdicts``; one consumer per process, no consumer group.

    It positions itself at the topic's end *before* the first trajectory is published,
    so no verdict of ours can be missed, and it never reads the topic's history. Recent
    verdicts are kept (bounded) so a caller that asks after the verdict passed still
    gets it.
    """

    def __init__(self, cfg: PipelineConfig, *, keep_recent: int = 10_000) -> None:
        self.cfg = cfg
        self.keep_recent = keep_recent
        self.recent: OrderedDict[str, GroupVerdict] = OrderedDict()
        self._waiting: dict[str, asyncio.Future[GroupVerdict]] = {}
        self._task: asyncio.Task[None] | None = None
        self._consumer: Any = None

    async def start(self) -> None:
        self._consumer = make_consumer(self.cfg.kafka, group_id=None, fetch_max_wait_ms=50)
        await self._consumer.start()
        try:
            tps = await partitions_of(self._consumer, self.cfg.topics.verdicts)
        except RuntimeError:
            await self._consumer.stop()
            raise
        self._consumer.assign(tps)
        await self._consumer.seek_to_end()
        for tp in tps:  # resolve the lazy seek now, before anything is published
            await self._consumer.position(tp)
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        """Stop the reader task and close its consumer."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    def expect(self, group_id: str) -> asyncio.Future[GroupVerdict]:
        """Register interest in ``group_id`` (call before publishing its member)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            raise RuntimeError("the verdict waiter stopped") from self._task.exception()
        fut = self._waiting.get(group_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            verdict = self.recent.get(group_id)
            if verdict is not None:
                fut.set_result(verdict)
            else:  # members of one group in this process share the future
                self._waiting[group_id] = fut
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
                for records in batch.values():
                    for record in records:
                        self._on_record(record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the broker client gave up: every waiter learns why
            log.exception("verdict waiter stopped")
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(exc)
            raise

    def _on_record(self, record: Any) -> None:
        try:
            verdict = decode_verdict(record.value, record.headers)
        except SchemaError as exc:
            log.warning("undecodable verdict at %s:%d: %s", record.partition, record.offset, exc)
            return
        self.recent[verdict.group_id] = verdict
        self.recent.move_to_end(verdict.group_id)
        while len(self.recent) > self.keep_recent:
            self.recent.popitem(last=False)
        fut = self._waiting.pop(verdict.group_id, None)
        if fut is not None and not fut.done():
            fut.set_result(verdict)


# --------------------------------------------------------------------------- the reward manager
@register(MANAGER_NAME)
class PRMRewardManager(NaiveRewardManager):
    """verl Reward Loop manager scoring every sample through the pipeline.

    Options come from ``reward.reward_kwargs`` (as verl's DAPO manager reads its own):
    ``prm_config`` (our YAML; default ``$PRM_CONFIG``), ``group_size`` (default
    ``actor_rollout_ref.rollout.n``), ``verdict_timeout_s`` (default the workers'
    ``group_timeout_s`` + 30 s: a group missing members is rejected by the workers
    before we give up), ``on_timeout`` (``outcome_only`` — the default: the sample keeps
    verl's outcome, no process rewards, ``prm_status=timeout`` — or ``raise``).
    """

    def __init__(self, config: Any, tokenizer: Any, compute_score: Any, reward_router_address: Any = None,
                 reward_model_tokenizer: Any = None, **options: Any) -> None:
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        opts = {**dict(_get(config, "reward.reward_kwargs", {}) or {}), **options}
        self.pipeline: PipelineConfig = load_config(opts.get("prm_config"))
        self.group_size = int(opts.get("group_size") or _get(config, "actor_rollout_ref.rollout.n", 1))
        self.verdict_timeout_s = float(opts.get("verdict_timeout_s", self.pipeline.worker.group_timeout_s + 30))
        self.on_timeout = str(opts.get("on_timeout", "outcome_only"))
        if self.on_timeout not in ("outcome_only", "raise"):
            raise ValueError(f"reward_kwargs.on_timeout must be 'outcome_only' or 'raise', got {self.on_timeout!r}")
        self.counts: Counter[str] = Counter()
        self._publisher: TrajectoryPublisher | None = None
        self._waiter: VerdictWaiter | None = None
        self._starting: asyncio.Lock | None = None

    async def _started(self) -> tuple[TrajectoryPublisher, VerdictWaiter]:
        """Kafka clients are created on first use, in the event loop verl runs us in."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._waiter is None:
                waiter = VerdictWaiter(self.pipeline)
                await waiter.start()
                publisher = TrajectoryPublisher(self.pipeline.kafka, self.pipeline.topics)
                await publisher.start()
                self._waiter, self._publisher = waiter, publisher
        assert self._publisher is not None and self._waiter is not None
        return self._publisher, self._waiter

    async def aclose(self) -> None:
        """Stop the Kafka clients (verl never calls this; tests and scripts do)."""
        if self._publisher is not None:
            await self._publisher.aclose()
            self._publisher = None
        if self._waiter is not None:
            await self._waiter.aclose()
            self._waiter = None

    async def run_single(self, data: DataProto) -> dict:
        result = await super().run_single(data)  # verl's outcome score, exactly as its naive manager
        outcome = float(result["reward_score"])
        item = data[-1:][0]  # multi-sequence outputs: the last sequence, like verl's managers
        if "uid" not in item.non_tensor_batch:
            raise KeyError("prm_pipeline needs the sample's group id in non_tensor_batch['uid'] (verl sets it for GRPO)")
        uid = str(item.non_tensor_batch["uid"])
        trajectory, spans = self._trajectory(item, uid, outcome, is_eval=bool(data.meta_info.get("validate", False)))
        publisher, waiter = await self._started()
        waiter.expect(uid)  # before publishing: the verdict cannot slip past us
        t0 = time.monotonic()
        await publisher.publish_ready(trajectory)
        await publisher.flush()
        verdict = await waiter.wait(uid, self.verdict_timeout_s)
        waited = time.monotonic() - t0
        valid_len = spans[-1][1] if spans else 0
        rewards = np.zeros(self._valid_response_len(item), dtype=np.float32)
        if verdict is None:
            status, reason = "timeout", f"no verdict for group {uid!r} within {self.verdict_timeout_s:g}s"
            log.warning("prm_pipeline: %s; the sample keeps its outcome score and gets no process rewards", reason)
            if self.on_timeout == "raise":
                raise VerdictTimeout(reason)
        else:
            status, reason = verdict.status, verdict.reason
            if status == "accepted":
                rewards[:valid_len] = self._aligned(verdict, trajectory, spans)
            else:
                log.info("prm_pipeline: group %s %s (%s): no process rewards", uid, status, reason)
        self.counts[status] += 1
        info = dict(result.get("reward_extra_info", {}))
        info.update(prm_status=status, prm_reason=reason, prm_process_reward=float(rewards.sum()),
                    prm_verdict_wait_s=waited)
        return {"reward_score": PRMScore(outcome, rewards, status), "reward_extra_info": info}

    @staticmethod
    def _valid_response_len(item: Any) -> int:
        response_len = item.batch["responses"].shape[-1]
        return int(item.batch["attention_mask"][-response_len:].sum())

    def _trajectory(self, item: Any, uid: str, outcome: float, *, is_eval: bool) -> tuple[ReadyTrajectory, list]:
        """One sample -> a concat-export trajectory: turn k's input is the prompt plus the response before it."""
        batch = item.batch
        prompt_len = batch["prompts"].shape[-1]
        attention = batch["attention_mask"].cpu().numpy()
        prompt = batch["prompts"].cpu().numpy()[attention[:prompt_len].astype(bool)]
        valid_len = self._valid_response_len(item)
        response = batch["responses"].cpu().numpy()[:valid_len]
        mask = batch["response_mask"].cpu().numpy() if "response_mask" in batch.keys() else None
        logprobs = batch["rollout_log_probs"].cpu().numpy()[:valid_len] if "rollout_log_probs" in batch.keys() else None
        spans = turn_spans(mask, valid_len)
        raw_prompt = item.non_tensor_batch.get("raw_prompt")
        history: list[dict[str, Any]] = [dict(m) for m in raw_prompt] if raw_prompt is not None else []
        trajectory_id = f"{uid}/{uuid.uuid4().hex}"
        interactions = []
        previous_end = 0
        for k, (start, end) in enumerate(spans):
            if start > previous_end:  # tool / user tokens between two model turns
                history.append({"role": "tool", "content": self.tokenizer.decode(response[previous_end:start])})
            answer = {"role": "assistant", "content": self.tokenizer.decode(response[start:end])}
            interactions.append(Interaction(
                interaction_id=f"t{k}", parent_id=f"t{k - 1}" if k else None,
                messages=list(history), output_message_list=[answer],
                model_response=ModelResponse.from_arrays(
                    np.concatenate([prompt, response[:start]]), response[start:end],
                    None if logprobs is None else logprobs[start:end],
                    "stop" if k < len(spans) - 1 or valid_len < batch["responses"].shape[-1] else "length"),
            ))
            history.append(answer)
            previous_end = end
        trajectory = ReadyTrajectory(
            trajectory_id=trajectory_id, session_id=trajectory_id, group_id=uid, group_size=self.group_size,
            interactions=interactions, outcome_reward=outcome, is_eval=is_eval, created_at=time.time(),
        )
        return trajectory, spans

    @staticmethod
    def _aligned(verdict: GroupVerdict, trajectory: ReadyTrajectory, spans: Sequence[tuple[int, int]]) -> np.ndarray:
        """The session's per-turn token rewards laid out on the response (0 between turns)."""
        out = np.zeros(spans[-1][1] if spans else 0, dtype=np.float32)
        session = next((s for s in verdict.sessions if s.trajectory_id == trajectory.trajectory_id), None)
        if session is None:
            raise RuntimeError(f"accepted verdict of group {verdict.group_id!r} lacks {trajectory.trajectory_id!r}")
        if not session.branches:  # the workers run with scoring off
            return out
        (branch,) = session.branches  # a verl sample is one chain of turns: one branch
        for k, (start, end) in enumerate(spans):
            values = branch.token_rewards[f"t{k}"].to_numpy()
            if len(values) != end - start:
                raise RuntimeError(f"group {verdict.group_id!r}: turn t{k} has {len(values)} rewards for "
                                   f"{end - start} tokens")
            out[start:end] = values
        return out

    @classmethod
    def assemble_rm_scores(cls, data: DataProto, scores: list[float]) -> torch.Tensor:
        """verl's placement of the outcome at the last response token, plus the process rewards.

        The last generated token (the last ``response_mask`` one, or the last valid
        token without a mask) carries only the outcome, so :func:`split_rewards` can
        take the two apart again in the advantage estimator.
        """
        rm_scores = super().assemble_rm_scores(data, [float(s) for s in scores])
        mask = data.batch["response_mask"] if "response_mask" in data.batch.keys() else None
        for i, score in enumerate(scores):
            rewards = getattr(score, "token_rewards", None)
            if rewards is None or not len(rewards):
                continue
            process = torch.as_tensor(rewards, dtype=rm_scores.dtype, device=rm_scores.device)
            n = process.shape[0]
            row_mask = torch.ones(n, dtype=torch.bool, device=rm_scores.device) if mask is None else mask[i, :n].bool()
            last = int(torch.nonzero(row_mask).max()) if bool(row_mask.any()) else -1
            process = torch.where(row_mask, process, torch.zeros_like(process))
            if last >= 0:
                process[last:] = 0
            rm_scores[i, :n] += process
        return rm_scores


# --------------------------------------------------------------------------- the advantage estimator
def split_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(outcome part, process rewards)`` of ``rm_scores`` built by :meth:`PRMRewardManager.assemble_rm_scores`.

    Everything from each row's last generated token on is the outcome (verl puts it at
    the last valid token, which is that token or a trailing tool token); everything
    before is process reward.
    """
    positions = torch.arange(token_level_rewards.shape[-1], device=token_level_rewards.device)
    last = torch.where(response_mask.bool(), positions, -1).amax(dim=-1, keepdim=True)
    outcome_zone = positions >= last
    zero = torch.zeros_like(token_level_rewards)
    return torch.where(outcome_zone, token_level_rewards, zero), torch.where(outcome_zone, zero, token_level_rewards)


@lru_cache(maxsize=8)
def _shaping_from_file(path: str | None) -> PRMAdvantageShapingConfig:
    return load_config(path).prm.advantage_shaping


def shaping_options(config: Any) -> dict[str, Any]:
    """Shaping mode and coefficients: our YAML (``algorithm.prm_config`` or ``$PRM_CONFIG``), then
    ``algorithm.prm_shaping`` overrides; AReaL's defaults (``additive``) without either."""
    shaping = _shaping_from_file(_get(config, "prm_config"))
    options = {"mode": shaping.mode, "negative_scale": shaping.negative_scale,
               "zero_penalty": shaping.zero_penalty, "zero_eps": shaping.zero_eps}
    overrides = _get(config, "prm_shaping", {}) or {}
    unknown = set(overrides) - set(options)
    if unknown:
        raise ValueError(f"algorithm.prm_shaping: unknown keys {sorted(unknown)}; known: {sorted(options)}")
    options.update({k: overrides[k] for k in overrides})
    return options


@core_algos.register_adv_est(ESTIMATOR_NAME)
def compute_prm_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    epsilon: float = 1e-6,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO on the outcome, then the process rewards folded in by :func:`shape_advantages`.

    Without process rewards this equals verl's ``grpo`` exactly. Process rewards are
    never group-normalised. Returns ``(advantages, returns)`` with returns = advantages,
    like verl's GRPO.
    """
    if index is None:
        raise ValueError("prm_grpo needs the group index: non_tensor_batch['uid'] must be set")
    if _get(config, "use_kl_in_reward", False):
        raise ValueError("prm_grpo needs algorithm.use_kl_in_reward=false: a KL penalty folded into the token "
                         "rewards would be shaped as a process reward (use actor.use_kl_loss instead)")
    outcome, process = split_rewards(token_level_rewards, response_mask)
    advantages, _returns = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=outcome, response_mask=response_mask, index=index, epsilon=epsilon,
        norm_adv_by_std_in_grpo=bool(_get(config, "norm_adv_by_std_in_grpo", True)), config=config,
    )
    shaped = shape_advantages(advantages, process, response_mask, **shaping_options(config))
    return shaped, shaped
