"""``PRMRunner``: scores one ready trajectory with the configured scorers.

Long on purpose: one run's validate-then-commit state machine and the lifecycle it guards read best in one place.

What a run does, and why it is shaped this way (AReaL's Process Rewards, "Scorer Contract",
"Branches, Filtering And Metrics"):

1. Every interaction must be token-backed (have a ``model_response``); this is checked
   before any scorer runs, so a malformed trajectory costs no judge calls.
2. The interaction tree is split into root-to-leaf branches. Each branch is scored on
   its own clone (:class:`~scoring_workers.prm.view.InteractionView` per turn), so a
   shared ancestor gets an independent, branch-local reward per branch and the
   caller's trajectory is never modified.
3. Enabled scorers run in config order. Per-turn scorers evaluate a branch's turns
   concurrently (judges overlap their I/O), but a scorer that returns without
   suspending is driven inline, with no task per turn (see :class:`_Resume`).
   Trajectory scorers are called once per branch.
4. A scorer's results are validated as a whole — reward shape and finiteness,
   observations, metric schema, the interaction's pre-existing token rewards — and
   only then committed (weighted by the scorer's weight and added to the branch's
   token rewards). As in AReaL, an exception propagates: a scorer's own exception
   unchanged (the first in turn order), the runner's checks as ``ValueError`` /
   ``TypeError`` / ``RuntimeError`` (``None`` from a scorer: ``RuntimeError``
   "returned None"). Each carries a note and a context saying where
   (:mod:`scoring_workers.prm.errors`, which also derives the worker's reason codes).
5. A :class:`ScoredTrajectory` exists only if every branch succeeded; metric schemas
   seen in the run are bound to their scorer name only then. Scorers may share a
   name (AReaL allows it): their contributions add up, their metrics merge and they
   share one observation schema.
6. ``error_policy: keep_original`` turns a scoring failure into an unscored result
   (original token rewards, ``fallback`` set) instead of an exception.

Lifecycle ("Scorer Lifecycle"): build with ``await PRMRunner.create(config)`` in async
code (rollback of owned scorers on start-up failure), close with ``await aclose()``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import struct
from collections.abc import Callable, Coroutine, Generator, Mapping, Sequence
from functools import partial
from types import CoroutineType
from typing import Any

import msgspec
import numpy as np
import torch

from infra.config import PRMConfig, validate_prm
from infra.schema import PRMMetricObservation, PRMTurnResult, ScorerInfo, TokenRewards
from infra.tree import TreeError, branches
from infra.types import validating
from scoring_workers.prm.base import BaseScorer, BaseTrajectoryScorer, PRMScorerResult
from scoring_workers.prm.errors import (
    PRMErrorContext,
    attach_context,
    failure_code,
    failure_detail,
    runner_error,
)
from scoring_workers.prm.resolve import build_scorer
from scoring_workers.prm.results import RunnerClosedError, ScoredBranch, ScoredTrajectory
from scoring_workers.prm.streamed import Reuse, StreamedResult, stream_key_bytes
from scoring_workers.prm.view import InteractionView, MessageCache

__all__ = ["PRMRunner"]

log = logging.getLogger(__name__)

_F32_MAX = float(np.finfo(np.float32).max)
_MISSING = object()

# (value_type, aggregations tuple): as in AReaL, the order of aggregations is part of it.
_Schema = tuple[str, tuple[str, ...]]
_SchemaTable = dict[tuple[str, str], _Schema]  # (scope, metric_id) -> schema


class _Invalid(Exception):
    """Internal: a scorer result broke a rule; raised as ``kind`` with context added.

    ``follows_subject``: the message continues its subject, as AReaL's wording does
    ("scorer 'x' must return shape (3,)"), so the place goes after it, not before.
    """

    def __init__(
        self,
        message: str,
        kind: type[Exception] = ValueError,
        reason: str = "invalid_reward",
        *,
        follows_subject: bool = False,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.reason = reason
        self.follows_subject = follows_subject

    def build(self, subject: str, place: str | None = None, **where: str | None) -> Exception:
        if self.follows_subject:
            text = f"{subject} {self}" + (f" ({place})" if place else "")
        else:
            text = f"{subject}{', ' + place if place else ''}: {self}"
        return runner_error(self.kind, text, self.reason, **where)


async def _as_coroutine(awaitable: Any, scorer_name: str) -> Any:
    """Accept any awaitable from ``evaluate_result`` (a coroutine is the norm)."""
    if not inspect.isawaitable(awaitable):
        raise TypeError(
            f"scorer {scorer_name!r}: evaluate_result() must be async (returned {type(awaitable).__name__})"
        )
    return await awaitable


def _coroutine(result: Any, scorer_name: str) -> Coroutine[Any, Any, Any]:
    return result if type(result) is CoroutineType else _as_coroutine(result, scorer_name)


async def _ready(result: PRMScorerResult) -> PRMScorerResult:
    """A reused result as the coroutine a scorer call would be (it finishes without waiting)."""
    return result


def _runner_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


_F32_STRUCT = struct.Struct("<f")


def _to_f32(value: float) -> float:
    """Round to the nearest float32 (callers check the range first)."""
    return _F32_STRUCT.unpack(_F32_STRUCT.pack(value))[0]


def _weighted(raw: Any, weight: float, output_len: int) -> tuple[float | torch.Tensor, float]:
    """Validate an unweighted result; return (weighted value, turn reward).

    The weighted value is a float (uniform over the turn; materialized later, which
    keeps scalar scorers free of tensor ops) or a fresh float32 tensor that aliases
    nothing the scorer holds. The turn reward is the mean weighted token reward.
    """
    if output_len <= 0:
        raise _Invalid(f"output_len is {output_len} (must be > 0); a scored turn needs at least one output token")
    if isinstance(raw, PRMScorerResult):
        raw = raw.reward
    if type(raw) is float or type(raw) is int or isinstance(raw, numbers.Real):
        value = float(raw)
    else:
        if isinstance(raw, torch.Tensor):
            tensor = raw.detach()
        elif isinstance(raw, (np.ndarray, np.generic, list, tuple)):
            try:
                tensor = torch.as_tensor(np.asarray(raw))
            except (TypeError, ValueError, RuntimeError) as exc:
                raise _Invalid(f"reward {type(raw).__name__} is not numeric: {exc}", TypeError) from None
        else:
            raise _Invalid(
                f"reward must be a number or a tensor of shape [{output_len}], got {type(raw).__name__}", TypeError
            )
        if tensor.is_complex() or tensor.dtype not in _REAL_DTYPES:
            raise _Invalid(f"reward tensor has unsupported dtype {tensor.dtype}", TypeError)
        if tuple(tensor.shape) != (output_len,):  # a 0-dim tensor too, as in AReaL
            raise _Invalid(  # AReaL's wording first (its tests match it), then ours
                f"must return shape ({output_len},), got a reward tensor of shape {list(tensor.shape)}; "
                f"n = output_len = {output_len}, or return a scalar",
                follows_subject=True,
            )
        tensor = tensor.to(device="cpu", dtype=torch.float32)
        if not bool(torch.isfinite(tensor).all()):
            raise _Invalid("reward tensor has non-finite values (in float32)")
        weighted = tensor * weight
        if not bool(torch.isfinite(weighted).all()):
            raise _Invalid(f"weighted reward tensor (weight {weight}) has non-finite values in float32")
        return weighted, float(weighted.mean())
    if not math.isfinite(value):
        raise _Invalid(f"reward {value!r} is non-finite")
    weighted_value = value * weight
    if not math.isfinite(weighted_value) or abs(weighted_value) > _F32_MAX:
        raise _Invalid(f"weighted reward {value!r} * {weight!r} is non-finite in float32")
    weighted_value = _to_f32(weighted_value)
    return weighted_value, weighted_value


_REAL_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    }
)


def _accumulate(acc: float | torch.Tensor, value: float | torch.Tensor) -> float | torch.Tensor:
    """Add one committed, weighted contribution to a turn's running token rewards."""
    if isinstance(acc, float):
        if isinstance(value, float):
            return acc + value
        return value.add_(acc) if acc else value  # value is our own fresh tensor
    if isinstance(value, float):
        return acc.add_(value) if value else acc
    if acc.shape != value.shape:  # cannot happen after validation; never add silently
        raise RuntimeError(f"token rewards shape {list(acc.shape)} != contribution shape {list(value.shape)}")
    return acc.add_(value)


def _dense(value: float | torch.Tensor | TokenRewards) -> torch.Tensor | float:
    """A channel entry as something :func:`_accumulate` takes (uniform stays a float)."""
    if isinstance(value, TokenRewards):
        return float(value.uniform) if value.uniform is not None else torch.from_numpy(value.to_numpy().copy())
    return value


def _finish(acc: float | torch.Tensor, output_len: int) -> TokenRewards | torch.Tensor:
    """A turn's final rewards: compact uniform form for scalar-only turns (see ScoredBranch).

    Each contribution was checked finite on its own; their *sum* can still overflow
    float32, which is refused like any other non-finite reward.
    """
    if isinstance(acc, float):
        if not abs(acc) <= _F32_MAX:
            raise _Invalid(f"summed token reward {acc!r} is non-finite in float32")
        return TokenRewards(length=output_len, uniform=_to_f32(acc))
    if not bool(torch.isfinite(acc).all()):
        raise _Invalid("summed token rewards are non-finite in float32")
    return acc


_Staged = tuple[
    float | torch.Tensor, float, tuple[PRMMetricObservation, ...]
]  # (weighted value, turn reward, observations)


def _branch_views(path: Sequence[Any], cache: MessageCache) -> list[InteractionView]:
    """One view per turn of the branch, each chained to its parent's: the branch-local
    clone scorers read, so a shared ancestor scores independently in every branch and
    the caller's interactions are never modified."""
    views: list[InteractionView] = []
    parent = None
    for interaction in path:
        parent = InteractionView(interaction, parent, cache)
        views.append(parent)
    return views


def _staged(
    scorer: BaseScorer, views: list[InteractionView], lengths: list[int], outcomes: list[Any], where: dict[str, Any]
) -> list[_Staged]:
    """Validate and weight one scorer's results for every turn of a branch, committing
    nothing: a scorer's results are accepted or refused as a whole (the first bad turn
    raises, with where)."""
    staged: list[_Staged] = []
    for view, output_len, outcome in zip(views, lengths, outcomes):
        try:
            value, reward = _weighted(outcome, scorer.weight, output_len)
        except _Invalid as exc:
            raise exc.build(
                f"scorer {scorer.name!r}",
                f"interaction {view.interaction_id!r}",
                interaction_id=view.interaction_id,
                **where,
            ) from None
        observations = outcome.observations if isinstance(outcome, PRMScorerResult) else ()
        if isinstance(observations, (str, bytes)) or not isinstance(observations, Sequence):
            raise runner_error(
                TypeError,
                f"scorer {scorer.name!r}: observations must be a sequence of "
                f"PRMMetricObservation, got {type(observations).__name__}",
                "invalid_observation",
                interaction_id=view.interaction_id,
                **where,
            )
        staged.append((value, reward, tuple(observations)))
    return staged


def _commit(
    name: str,
    staged: list[_Staged],
    views: list[InteractionView],
    lengths: list[int],
    acc: list[float | torch.Tensor],
    turn_results: list[PRMTurnResult],
    channel: dict[str, TokenRewards | torch.Tensor] | None,
) -> float:
    """Add one scorer's validated contributions to the branch: its running token sums
    (``acc``, in place), its turn results and, with ``keep_channels``, the scorer's
    channel. Returns the scorer's branch total (the sum of its turn rewards)."""
    total = 0.0
    for i, (value, reward, observations) in enumerate(staged):
        iid = views[i].interaction_id
        if channel is not None:
            value = _keep_in_channel(channel, iid, lengths[i], value)
        acc[i] = _accumulate(acc[i], value)
        turn_results.append(
            PRMTurnResult(interaction_id=iid, scorer_name=name, reward=reward, observations=observations)
        )
        total += reward
    return total


def _keep_in_channel(
    channel: dict[str, TokenRewards | torch.Tensor], iid: str, output_len: int, value: float | torch.Tensor
) -> float | torch.Tensor:
    """Record a turn's weighted contribution in its scorer's channel; return what the
    running sum may take. :func:`_accumulate` adds in place into its tensors: the
    channel keeps the original, the running sum gets a copy. Same-named scorers share
    one channel: a second contribution to a turn is summed there, on copies."""
    mine = TokenRewards(length=output_len, uniform=value) if isinstance(value, float) else value
    if iid in channel:
        prev, add = _dense(channel[iid]), _dense(mine)
        summed = _accumulate(
            prev.clone() if isinstance(prev, torch.Tensor) else prev,
            add.clone() if isinstance(add, torch.Tensor) else add,
        )
        mine = TokenRewards(length=output_len, uniform=_to_f32(summed)) if isinstance(summed, float) else summed
    channel[iid] = mine
    return value if isinstance(value, float) else value.clone()


def _finished(
    views: list[InteractionView], lengths: list[int], acc: list[float | torch.Tensor], leaf_id: str, trajectory_id: str
) -> dict[str, TokenRewards | torch.Tensor]:
    """Every turn's final token rewards, keyed in path order (the branch's ``path``); a
    sum that overflows float32 is refused, saying which turn."""
    token_rewards: dict[str, TokenRewards | torch.Tensor] = {}
    for view, output_len, a in zip(views, lengths, acc):
        try:
            token_rewards[view.interaction_id] = _finish(a, output_len)
        except _Invalid as exc:
            raise exc.build(
                f"interaction {view.interaction_id!r}",
                interaction_id=view.interaction_id,
                leaf_id=leaf_id,
                trajectory_id=trajectory_id,
            ) from None
    return token_rewards


class PRMRunner:
    """Scores ready trajectories with the scorers of one :class:`PRMConfig`.

    ``config.scorers`` entries may be :class:`PRMScorerConfig` / mappings (resolved by
    import path, constructed and **owned** by the runner, which closes them) or
    :class:`BaseScorer` instances (**borrowed**: their caller closes them). Disabled
    scorers are constructed (their configuration is checked at start-up) but not run;
    nothing runs when ``config.enabled`` is false.

    Prefer ``await PRMRunner.create(config)`` in async code: it rolls back on start-up
    failure. ``PRMRunner(config)`` remains for synchronous callers, without rollback
    and without support for async ``validate_prm_config`` hooks.
    """

    def __init__(self, config: PRMConfig | Mapping[str, Any], *, allowed_prefixes: Sequence[str] | None = None) -> None:
        self._build(config, allowed_prefixes)
        for scorer in self._scorers:
            outcome = self._call_validator(scorer)
            if inspect.isawaitable(outcome):
                if inspect.iscoroutine(outcome):
                    outcome.close()
                raise TypeError(
                    f"scorer {scorer.name!r} has an async validate_prm_config hook; build the runner "
                    "with `await PRMRunner.create(config)`"
                )

    @classmethod
    async def create(
        cls, config: PRMConfig | Mapping[str, Any], *, allowed_prefixes: Sequence[str] | None = None
    ) -> PRMRunner:
        """Build a runner: resolve and construct every scorer, then call each scorer's
        optional ``validate_prm_config(config, *, training_enabled)`` hook (awaited when
        it returns an awaitable; ``training_enabled`` is False for disabled scorers).

        If anything fails, the owned scorers built so far are closed in reverse order
        and the **original** exception is re-raised; ordinary cleanup failures are
        logged and attached to it as notes. Cancellation during that cleanup
        propagates. Borrowed scorers are never closed; a scorer whose own constructor
        raised is not closed either (it cleans up after itself).
        """
        self = cls.__new__(cls)
        self._owned = []
        try:
            self._build(config, allowed_prefixes)
            for scorer in self._scorers:
                outcome = self._call_validator(scorer)
                if inspect.isawaitable(outcome):
                    await outcome
        except BaseException as exc:
            self._closing = True
            await self._rollback(exc)
            raise
        return self

    # ------------------------------------------------------------------ construction
    def _build(self, config: PRMConfig | Mapping[str, Any], allowed_prefixes: Sequence[str] | None) -> None:
        """Resolve and construct every configured scorer (shared by both constructors)."""
        self._setup(config, allowed_prefixes)
        for index, item in enumerate(self._config.scorers):
            self._add(index, item)
        self._check_names()

    def _setup(self, config: PRMConfig | Mapping[str, Any], allowed_prefixes: Sequence[str] | None) -> None:
        if isinstance(config, Mapping):
            with validating("prm", root=PRMConfig):
                config = msgspec.convert(dict(config), PRMConfig, strict=False)
        if not isinstance(config, PRMConfig):
            raise TypeError(f"config must be a PRMConfig or a mapping, got {type(config).__name__}")
        validate_prm(config)
        self._config = config
        self._allowed_prefixes = allowed_prefixes
        self._scorers: list[BaseScorer] = []
        self._owned: list[BaseScorer] = []
        self._active: tuple[BaseScorer, ...] = ()
        self._schemas: dict[str, _SchemaTable] = {}
        self._closing = False
        self._close_future: asyncio.Future[None] | None = None
        self._close_done = False
        self._inflight = 0

    def _add(self, index: int, item: Any) -> None:
        try:
            scorer, owned = build_scorer(item, allowed_prefixes=self._allowed_prefixes)
        except Exception as exc:  # keep the original error; say which entry it came from
            what = getattr(item, "path", None) or (item.get("path") if isinstance(item, Mapping) else None)
            exc.add_note(f"while building rollout.agent.prm.scorers[{index}]" + (f" ({what})" if what else ""))
            raise
        if owned:
            self._owned.append(scorer)
        self._scorers.append(scorer)

    def _check_names(self) -> None:
        """Names must be set; they need not be unique (AReaL: same-named scorers add up
        and share their name's metrics and observation schema)."""
        for scorer in self._scorers:
            name = getattr(type(scorer), "name", None)
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"{type(scorer).__qualname__} must set a non-empty class-level `name`")
            if not hasattr(scorer, "weight") or not hasattr(scorer, "enabled"):
                raise TypeError(f"scorer {name!r}: its __init__ must call BaseScorer.__init__")
            if name.endswith("__count"):
                raise ValueError(f"scorer name {name!r} must not end with '__count' (reserved by metrics)")
        if self._config.enabled:
            self._active = tuple(s for s in self._scorers if s.enabled)

    def _call_validator(self, scorer: BaseScorer) -> Any:
        hook = getattr(scorer, "validate_prm_config", None)
        if hook is None:
            return None
        return hook(self._config, training_enabled=bool(self._config.enabled and scorer.enabled))

    async def _rollback(self, error: BaseException) -> None:
        for scorer in reversed(self._owned):
            try:
                await scorer.aclose()
            except Exception as cleanup:
                log.error("PRM start-up rollback: closing scorer %r failed", scorer.name, exc_info=cleanup)
                error.add_note(
                    f"PRM scorer cleanup failed while rolling back PRMRunner.create(): "
                    f"{scorer.name}.aclose() raised {cleanup!r}"
                )
        self._owned = []
        self._close_done = True

    # ------------------------------------------------------------------ introspection
    @property
    def config(self) -> PRMConfig:
        return self._config

    @property
    def scorers(self) -> tuple[BaseScorer, ...]:
        """Every scorer, in config order (disabled and borrowed ones included)."""
        return tuple(self._scorers)

    @property
    def active(self) -> bool:
        """Whether a run would call at least one scorer."""
        return bool(self._active)

    @property
    def closing(self) -> bool:
        return self._closing

    def scorer_infos(self) -> list[ScorerInfo]:
        """(name, version) of the scorers a run calls, in config order (for verdicts)."""
        return [ScorerInfo(s.name, s.version) for s in self._active]

    # ------------------------------------------------------------------ scoring
    async def run(
        self,
        trajectory: Any,
        *,
        is_eval: bool | None = None,
        ctx: Mapping[str, Any] | None = None,
        keep_channels: bool = False,
        reuse: Reuse | None = None,
    ) -> ScoredTrajectory:
        """Score every branch of ``trajectory`` (a :class:`~infra.schema.ReadyTrajectory`).

        ``is_eval`` defaults to ``trajectory.is_eval``. Each scorer call receives its own
        copy of ``ctx`` with ``is_eval``, ``messages`` (the branch's full conversation:
        the leaf's input messages followed by its output messages, read-only),
        ``trajectory_id``, ``session_id`` and ``leaf_id`` set.

        ``keep_channels`` also keeps every scorer's own weighted token rewards per turn
        (:attr:`ScoredBranch.channels`, the worker's ``worker.keep_scorer_channels``):
        the summed rewards cannot be taken apart again by a trainer that combines
        scorers differently. Off by default, because it costs a copy of every tensor
        contribution.

        ``reuse`` (a streamed session's end): turn results computed before the session
        ended (:meth:`score_turn`), taken instead of calling the scorer again where the
        branch gives the same stream key (:mod:`scoring_workers.prm.streamed`).

        Under ``error_policy: keep_original`` a failure (any ``Exception`` but a closed
        runner) returns the trajectory unscored instead: its original token rewards,
        no scorer contributions, :attr:`ScoredTrajectory.fallback` saying what failed.

        Raises:
            Exception: the scorer's own exception, or ``ValueError`` / ``TypeError`` /
                ``RuntimeError`` from the runner's checks, each with a note and a
                :class:`~scoring_workers.prm.errors.PRMErrorContext`
                (:func:`~scoring_workers.prm.errors.failure_code` names the reason).
            RunnerClosedError: :meth:`aclose` has started (a ``RuntimeError``).
        """
        if self._closing:
            raise RunnerClosedError("PRMRunner is closing or closed; run() is no longer accepted")
        self._inflight += 1
        try:
            return await self._run(trajectory, is_eval, ctx, keep_channels, reuse)
        except Exception as exc:
            if self._config.error_policy != "keep_original":
                raise
            fallback = f"keep_original: {failure_code(exc)}: {failure_detail(exc)}"[:2000]
            log.info(
                "trajectory %s: scoring failed, keeping the original: %s",
                getattr(trajectory, "trajectory_id", "?"),
                fallback,
            )
            return self._original(trajectory, is_eval, fallback)
        finally:
            self._inflight -= 1

    @property
    def streams(self) -> bool:
        """Whether :meth:`score_turn` has anything to run (an active streamable per-turn scorer)."""
        return any(s.streamable and not isinstance(s, BaseTrajectoryScorer) for s in self._active)

    async def score_turn(
        self, turn: Any, next_turn: Any, ctx: Mapping[str, Any], cache: MessageCache | None = None
    ) -> list[StreamedResult]:
        """Run the active :attr:`~scoring_workers.prm.BaseScorer.streamable` per-turn
        scorers on ``turn`` of a streamed session, now that ``next_turn`` (a child of it,
        full form) brought its next state.

        Each call gets ``ctx`` (the session's ``session_id`` and ``trajectory_id``) plus
        ``leaf_id`` = the child's id and ``messages`` = the child's conversation and
        output: the conversation up to and including ``turn``'s next state, not the whole
        branch (docs/compatibility.md); ``is_eval`` is not known yet and is left out. The
        view has no ``parent`` (a streamable scorer reads its turn only). A scorer that
        raises or returns None here is simply called again when the session ends, where
        its failure counts as for a ``ready`` session: only successes are returned.
        ``cache``: the session's frozen messages, kept by the caller across its turns (a
        message is then frozen once per session, not once per turn).
        """
        if self._closing:
            raise RunnerClosedError("PRMRunner is closing or closed; score_turn() is no longer accepted")
        targets = [
            (i, s) for i, s in enumerate(self._active) if s.streamable and not isinstance(s, BaseTrajectoryScorer)
        ]
        if not targets or turn.model_response is None:
            return []
        self._inflight += 1
        try:
            cache = {} if cache is None else cache
            view, child = InteractionView(turn, None, cache), InteractionView(next_turn, None, cache)
            call_ctx = dict(ctx)
            call_ctx.pop("is_eval", None)
            call_ctx["leaf_id"] = next_turn.interaction_id
            call_ctx["messages"] = child.messages + child.output_message_list
            outcomes = await asyncio.gather(
                *(_coroutine(s.evaluate_result(view, dict(call_ctx)), s.name) for _, s in targets),
                return_exceptions=True,
            )
            results = []
            for (index, scorer), outcome in zip(targets, outcomes):
                if isinstance(outcome, PRMScorerResult):
                    results.append(
                        StreamedResult.of(
                            index, scorer.name, turn.interaction_id, stream_key_bytes(scorer, view, call_ctx), outcome
                        )
                    )
                elif isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                    raise outcome  # cancelled: the worker is stopping
                else:
                    log.debug(
                        "streamed turn %s: scorer %r gave %s; it runs again at the session's end",
                        turn.interaction_id,
                        scorer.name,
                        type(outcome).__name__,
                    )
            return results
        finally:
            self._inflight -= 1

    def _original(self, trajectory: Any, is_eval: bool | None, fallback: str) -> ScoredTrajectory:
        """``keep_original``: every branch with the turns' pre-existing token rewards only
        (zeros where there are none), no turn results, no scorer totals."""
        if is_eval is None:
            is_eval = bool(getattr(trajectory, "is_eval", False))
        scored: list[ScoredBranch] = []
        for path in branches(trajectory.interactions):
            rewards: dict[str, TokenRewards | torch.Tensor] = {}
            for interaction in path:
                n = interaction.model_response.output_len if interaction.model_response is not None else 0
                existing = getattr(interaction, "token_rewards", None)
                if existing is not None and len(existing) == n and bool(np.isfinite(existing).all()):
                    rewards[interaction.interaction_id] = TokenRewards.from_array(existing)
                else:  # none, or unusable (that may be what failed): nothing to keep
                    rewards[interaction.interaction_id] = TokenRewards(length=n, uniform=0.0)
            scored.append(ScoredBranch(path[-1].interaction_id, list(rewards), rewards, {}, []))
        return ScoredTrajectory(
            trajectory_id=trajectory.trajectory_id,
            session_id=trajectory.session_id,
            branches=scored,
            is_eval=is_eval,
            fallback=fallback,
        )

    async def _run(
        self,
        trajectory: Any,
        is_eval: bool | None,
        ctx: Mapping[str, Any] | None,
        keep_channels: bool = False,
        reuse: Reuse | None = None,
    ) -> ScoredTrajectory:
        trajectory_id = trajectory.trajectory_id
        if is_eval is None:
            is_eval = bool(getattr(trajectory, "is_eval", False))
        interactions = trajectory.interactions
        for interaction in interactions:
            if interaction.model_response is None:
                raise runner_error(
                    ValueError,
                    f"trajectory {trajectory_id!r}: interaction {interaction.interaction_id!r} has no "
                    "model_response; PRM scorers require token-backed interactions",
                    "not_token_backed",
                    interaction_id=interaction.interaction_id,
                    trajectory_id=trajectory_id,
                )
        try:
            paths = branches(interactions)
        except TreeError as exc:  # a ValueError ("... cycle ..." for cycles, as AReaL)
            attach_context(exc, PRMErrorContext("invalid_trajectory", trajectory_id=trajectory_id))
            raise
        base_ctx = dict(ctx) if ctx else {}
        base_ctx["is_eval"] = is_eval
        base_ctx["trajectory_id"] = trajectory_id
        base_ctx["session_id"] = trajectory.session_id
        cache: MessageCache = {} if reuse is None else reuse.frozen  # a streamed session's, frozen as it came
        pending: dict[str, _SchemaTable] = {}
        scored = [
            await self._score_branch(path, base_ctx, cache, pending, trajectory_id, keep_channels, reuse)
            for path in paths
        ]
        self._bind_schemas(pending, trajectory_id)
        return ScoredTrajectory(
            trajectory_id=trajectory_id, session_id=trajectory.session_id, branches=scored, is_eval=is_eval
        )

    async def _score_branch(
        self,
        path: Sequence[Any],
        base_ctx: dict[str, Any],
        cache: MessageCache,
        pending: dict[str, _SchemaTable],
        trajectory_id: str,
        keep_channels: bool = False,
        reuse: Reuse | None = None,
    ) -> ScoredBranch:
        """Score one root-to-leaf branch: the active scorers in config order, each one's
        results validated as a whole (:func:`_staged`, :meth:`_check_observations`)
        before any of them is committed (:func:`_commit`)."""
        views = _branch_views(path, cache)
        leaf_id = views[-1].interaction_id
        ctx = self._branch_ctx(base_ctx, views[-1])
        lengths = [view.model_response.output_len for view in views]
        acc: list[float | torch.Tensor] | None = None  # the running sums, once the existing rewards are checked
        turn_results: list[PRMTurnResult] = []
        totals: dict[str, float] = {}
        channels: dict[str, dict[str, TokenRewards | torch.Tensor]] = {}
        for index, scorer in enumerate(self._active):
            name = scorer.name
            where = {"scorer_name": name, "leaf_id": leaf_id, "trajectory_id": trajectory_id}
            if isinstance(scorer, BaseTrajectoryScorer):
                outcomes = await self._evaluate_branch(scorer, views, ctx, where)
            else:
                reused = None if reuse is None or not scorer.streamable else partial(reuse.lookup, index, scorer)
                outcomes = await self._evaluate_turns(scorer, views, ctx, where, reused)
            staged = _staged(scorer, views, lengths, outcomes, where)
            schema = self._check_observations(name, views, staged, pending, where)
            if acc is None:  # AReaL checks pre-existing rewards in the scorer step
                acc = self._existing_rewards(views, lengths, where)
            if schema:
                pending.setdefault(name, {}).update(schema)
            channel: dict[str, TokenRewards | torch.Tensor] | None = channels.get(name, {}) if keep_channels else None
            total = _commit(name, staged, views, lengths, acc, turn_results, channel)
            totals[name] = totals.get(name, 0.0) + total  # same-named scorers: one total
            if channel is not None:
                channels[name] = channel
        if acc is None:
            acc = self._existing_rewards(views, lengths, {"leaf_id": leaf_id, "trajectory_id": trajectory_id})
        token_rewards = _finished(views, lengths, acc, leaf_id, trajectory_id)
        return ScoredBranch(
            leaf_id=leaf_id,
            path=list(token_rewards),
            token_rewards=token_rewards,
            scorer_totals=totals,
            turn_results=turn_results,
            channels=channels,
        )

    def _branch_ctx(self, base_ctx: dict[str, Any], leaf: InteractionView) -> dict[str, Any]:
        """The ctx this branch's scorer calls each get a copy of: the run's, plus
        ``leaf_id`` and ``messages`` (the branch's whole conversation, built only when a
        scorer will run)."""
        ctx = dict(base_ctx)
        ctx["leaf_id"] = leaf.interaction_id
        ctx["messages"] = leaf.messages + leaf.output_message_list if self._active else ()
        return ctx

    @staticmethod
    def _existing_rewards(
        views: list[InteractionView], lengths: list[int], where: dict[str, Any]
    ) -> list[float | torch.Tensor]:
        """The running sums' start: each turn's pre-existing token rewards (AReaL adds
        scorer contributions to them), shape- and finiteness-checked; 0.0 where none."""
        start: list[float | torch.Tensor] = []
        for view, n in zip(views, lengths):
            existing = view.token_rewards
            if existing is None:
                start.append(0.0)
                continue
            context = {"interaction_id": view.interaction_id, **where}
            if existing.shape != (n,):
                raise runner_error(
                    ValueError,
                    f"interaction {view.interaction_id!r}: Existing token_rewards shape mismatch: "
                    f"{list(existing.shape)} vs output_len {n}",
                    "invalid_reward",
                    **context,
                )
            tensor = torch.tensor(existing, dtype=torch.float32)  # a copy: the wire bytes stay untouched
            if not bool(torch.isfinite(tensor).all()):
                raise runner_error(
                    ValueError,
                    f"interaction {view.interaction_id!r}: Existing token_rewards are non-finite",
                    "invalid_reward",
                    **context,
                )
            start.append(tensor)
        return start

    async def _evaluate_turns(
        self,
        scorer: BaseScorer,
        views: list[InteractionView],
        ctx: dict[str, Any],
        where: dict[str, Any],
        reused: Callable[[InteractionView, dict[str, Any]], PRMScorerResult | None] | None = None,
    ) -> list[Any]:
        """Evaluate every turn; return results in turn order or raise.

        Turns are started in order and driven inline until one suspends; from then on
        the suspended turn is finished in this task while the remaining turns run as
        concurrent tasks. Synchronous scorers thus cost no task per turn, and judges
        still overlap their requests. As in AReaL, every turn is awaited; then the
        first exception in turn order is re-raised as it is, else ``None`` results
        raise ``RuntimeError`` "returned None" (exceptions win over None).

        ``reused`` gives a turn's result computed before a streamed session ended (None:
        call the scorer): such a turn costs no call and no task.
        """
        n = len(views)
        outcomes: list[Any] = [None] * n

        def call(view: InteractionView) -> Coroutine[Any, Any, Any]:
            hit = None if reused is None else reused(view, ctx)
            return _ready(hit) if hit is not None else _coroutine(scorer.evaluate_result(view, dict(ctx)), scorer.name)

        i = 0
        while i < n:
            coro = call(views[i])
            try:
                first = coro.send(None)
            except StopIteration as stop:
                outcomes[i] = stop.value
                i += 1
                continue
            except Exception as exc:  # noqa: BLE001 - every earlier turn succeeded: first in order
                raise self._scorer_error(exc, views[i], where)  # noqa: B904 - the original exception, re-raised unchanged (AReaL)
            except asyncio.CancelledError as exc:
                if _runner_cancelled():
                    raise
                raise self._scorer_error(exc, views[i], where)  # noqa: B904 - the original exception, re-raised unchanged (AReaL)
            rest = [asyncio.ensure_future(call(views[j])) for j in range(i + 1, n)]
            try:
                try:
                    outcomes[i] = await _Resume(coro, first)
                except Exception as exc:  # noqa: BLE001 - ranked below by turn order
                    outcomes[i] = exc
                except asyncio.CancelledError as exc:
                    if _runner_cancelled():
                        raise
                    outcomes[i] = exc
                if rest:
                    outcomes[i + 1 :] = await asyncio.gather(*rest, return_exceptions=True)
            except BaseException:
                for task in rest:
                    task.cancel()
                if rest:
                    await asyncio.gather(*rest, return_exceptions=True)
                raise
            break
        nones = 0
        for view, outcome in zip(views, outcomes):
            if isinstance(outcome, BaseException):
                raise self._scorer_error(outcome, view, where)
            if outcome is None:
                nones += 1
        if nones:
            raise runner_error(
                RuntimeError,
                f"PRM scorer {scorer.name!r} returned None for {nones}/{n} interactions of branch "
                f"{where['leaf_id']!r} (None rejects the trajectory; return 0.0 for a deliberate zero)",
                "scorer_returned_none",
                **where,
            )
        return outcomes

    async def _evaluate_branch(
        self, scorer: BaseTrajectoryScorer, views: list[InteractionView], ctx: dict[str, Any], where: dict[str, Any]
    ) -> list[Any]:
        """Call ``evaluate_trajectory`` once; map its answer onto the branch's turns (AReaL's rules)."""
        try:
            answer = await scorer.evaluate_trajectory(list(views), dict(ctx))
        except Exception as exc:  # noqa: BLE001
            raise self._scorer_error(exc, None, where)  # noqa: B904 - the original exception, re-raised unchanged (AReaL)
        except asyncio.CancelledError as exc:
            if _runner_cancelled():
                raise
            raise self._scorer_error(exc, None, where)  # noqa: B904 - the original exception, re-raised unchanged (AReaL)
        n = len(views)
        if answer is None:
            raise runner_error(
                RuntimeError,
                f"PRM trajectory scorer {scorer.name!r} returned None for {n}/{n} interactions "
                f"of branch {where['leaf_id']!r}",
                "scorer_returned_none",
                **where,
            )
        if not isinstance(answer, Mapping):
            raise runner_error(
                TypeError,
                f"trajectory scorer {scorer.name!r} must return a mapping interaction_id -> reward, "
                f"got {type(answer).__name__}",
                "invalid_reward",
                **where,
            )
        if any(key is None for key in answer):
            raise runner_error(
                ValueError,
                f"trajectory scorer {scorer.name!r} returned a None interaction id",
                "invalid_reward",
                **where,
            )
        index = {view.interaction_id: i for i, view in enumerate(views)}
        unknown = sorted(repr(key) for key in answer if key not in index)
        if unknown:
            raise runner_error(
                ValueError,
                f"trajectory scorer {scorer.name!r} returned unknown interaction ids "
                f"[{', '.join(unknown)}] (branch {where['leaf_id']!r} has {list(index)})",
                "invalid_reward",
                **where,
            )
        values: list[Any] = [_MISSING] * n
        for key, value in answer.items():
            values[index[key]] = value
        outcomes: list[Any] = []
        nones = 0
        for view, value in zip(views, values):
            if value is _MISSING:  # omitted ids score 0.0
                outcomes.append(0.0)
            elif value is None:
                nones += 1
                outcomes.append(None)
            else:
                try:
                    outcomes.append(scorer.prepare_result(view, value, dict(ctx)))
                except Exception as exc:  # noqa: BLE001
                    raise self._scorer_error(exc, view, where)  # noqa: B904 - the original exception, re-raised unchanged (AReaL)
        if nones:
            raise runner_error(
                RuntimeError,
                f"PRM trajectory scorer {scorer.name!r} returned None for {nones}/{n} interactions "
                f"of branch {where['leaf_id']!r} (return 0.0 for a deliberate zero, or leave the id out)",
                "scorer_returned_none",
                **where,
            )
        return outcomes

    @staticmethod
    def _scorer_error(exc: BaseException, view: InteractionView | None, where: dict[str, Any]) -> BaseException:
        """The scorer's own exception, unchanged but for a note and a context (AReaL
        re-raises the original object; we keep where it happened on it)."""
        return attach_context(
            exc,
            PRMErrorContext(
                reason="scorer_error",
                interaction_id=None if view is None else view.interaction_id,
                raised_by_scorer=True,
                **where,
            ),
        )

    def _check_observations(
        self,
        scorer_name: str,
        views: list[InteractionView],
        staged: list[_Staged],
        pending: dict[str, _SchemaTable],
        where: dict[str, Any],
    ) -> _SchemaTable:
        """Validate one scorer's observations for one branch; return its new schema entries.

        AReaL's rules and error types: each item is a :class:`PRMMetricObservation`
        (TypeError); a turn observation targets its own turn; (scope, target, metric)
        occurs once per scorer *object* and branch; a metric keeps one (value_type,
        aggregations) within the run; and after each interaction every schema must equal
        the one bound to this scorer **name** — by an earlier run, or earlier in this run
        by a same-named scorer ("schema changed across runs").
        """
        seen: set[tuple[str, str, str]] = set()
        local: _SchemaTable = {}
        bound = self._schemas.get(scorer_name, {})
        mine = pending.get(scorer_name, {})
        for view, (_value, _reward, observations) in zip(views, staged):
            context = {"interaction_id": view.interaction_id, **where}
            for obs in observations:
                if not isinstance(obs, PRMMetricObservation):
                    raise runner_error(
                        TypeError,
                        f"scorer {scorer_name!r} observations must contain PRMMetricObservation, "
                        f"got {type(obs).__name__} (interaction {view.interaction_id!r})",
                        "invalid_observation",
                        **context,
                    )
                if not isinstance(obs.target_id, str) or not obs.target_id.strip():
                    raise runner_error(
                        ValueError,
                        f"scorer {scorer_name!r}: observation {obs.metric_id!r} needs a non-empty target_id",
                        "invalid_observation",
                        **context,
                    )
                if obs.scope == "turn" and obs.target_id != view.interaction_id:
                    raise runner_error(
                        ValueError,
                        f"scorer {scorer_name!r}: turn observation {obs.metric_id!r} targets "
                        f"{obs.target_id!r}, expected {view.interaction_id!r}",
                        "invalid_observation",
                        **context,
                    )
                key = (obs.scope, obs.target_id, obs.metric_id)
                if key in seen:
                    raise runner_error(
                        ValueError,
                        f"scorer {scorer_name!r}: duplicate structured metric {obs.metric_id!r} "
                        f"({obs.scope} observation for target {obs.target_id!r})",
                        "invalid_observation",
                        **context,
                    )
                seen.add(key)
                schema_key: tuple[str, str] = (obs.scope, obs.metric_id)
                schema: _Schema = (obs.value_type, tuple(obs.aggregations))
                known = local.get(schema_key)
                if known is not None and known != schema:
                    raise runner_error(
                        ValueError,
                        f"scorer {scorer_name!r}: inconsistent schema for {obs.scope} metric "
                        f"{obs.metric_id!r} within one run: {known[0]} {list(known[1])} vs {schema[0]} "
                        f"{list(schema[1])}",
                        "invalid_observation",
                        **context,
                    )
                local[schema_key] = schema
            for schema_key, schema in local.items():
                known = mine.get(schema_key) or bound.get(schema_key)
                if known is not None and known != schema:
                    raise runner_error(
                        ValueError,
                        f"PRM scorer {scorer_name!r}: structured metric schema changed across runs "
                        f"for {schema_key[0]} metric {schema_key[1]!r}: {known[0]} {list(known[1])} -> "
                        f"{schema[0]} {list(schema[1])}",
                        "invalid_observation",
                        **context,
                    )
        return local

    def _bind_schemas(self, pending: dict[str, _SchemaTable], trajectory_id: str) -> None:
        """Bind the run's metric schemas, re-checked here because concurrent runs may
        have bound the same metric meanwhile (no await between check and bind)."""
        for scorer_name, table in pending.items():
            bound = self._schemas.get(scorer_name, {})
            for schema_key, schema in table.items():
                known = bound.get(schema_key)
                if known is not None and known != schema:
                    raise runner_error(
                        ValueError,
                        f"PRM scorer {scorer_name!r}: structured metric schema changed across runs "
                        f"for {schema_key[0]} metric {schema_key[1]!r}: {known[0]} {list(known[1])} -> "
                        f"{schema[0]} {list(schema[1])} (concurrent run)",
                        "invalid_observation",
                        scorer_name=scorer_name,
                        trajectory_id=trajectory_id,
                    )
        for scorer_name, table in pending.items():
            self._schemas.setdefault(scorer_name, {}).update(table)

    # ------------------------------------------------------------------ lifecycle
    async def aclose(self) -> None:
        """Close the scorers this runner owns, once each, in reverse creation order.

        Disabled owned scorers are closed too; borrowed instances never are. New
        :meth:`run` calls are refused from the first call on (drain scoring first).
        Concurrent callers wait for the same cleanup and see its outcome; ordinary
        failures are logged and raised together as an :class:`ExceptionGroup` after
        every owned scorer was attempted. Cancellation propagates immediately and ends
        the close: the interrupted hook and any not yet attempted are not retried.
        Calls after the close finished return at once and retry nothing.
        """
        self._closing = True
        if self._close_done:
            return
        if self._close_future is not None:
            await asyncio.shield(self._close_future)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._close_future = future
        if self._inflight:
            log.warning("PRMRunner.aclose(): %d run(s) still in flight; drain scoring before closing", self._inflight)
        errors: list[Exception] = []
        remaining = list(reversed(self._owned))
        try:
            while remaining:
                scorer = remaining.pop(0)  # popped first: closed at most once, even if interrupted
                try:
                    await scorer.aclose()
                except Exception as exc:
                    log.error("PRM scorer %r failed to close", scorer.name, exc_info=exc)
                    errors.append(exc)
        except BaseException:
            self._close_done = True
            if remaining:
                log.warning("PRMRunner.aclose() interrupted; scorers left unclosed: %s", [s.name for s in remaining])
            future.cancel()
            raise
        self._close_done = True
        if errors:
            group = ExceptionGroup(f"PRM scorer cleanup failed ({len(errors)} scorer(s))", errors)
            future.set_exception(group)
            future.exception()  # mark retrieved: concurrent waiters (if any) re-raise it
            raise group
        future.set_result(None)

    async def __aenter__(self) -> PRMRunner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        names = [s.name for s in self._scorers]
        return f"PRMRunner(scorers={names}, active={[s.name for s in self._active]}, closing={self._closing})"


class _Resume:
    """Await a coroutine whose first step was already run by hand (a scorer that finishes
    without suspending costs no task: :meth:`PRMRunner._evaluate_turns`).

    A coroutine that did suspend is finished *in the same task* through this object,
    which forwards every later send/throw exactly as ``await`` would (PEP 380), so
    ``asyncio.timeout()``, contextvars and cancellation inside the coroutine see one
    consistent task.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._first
        self._first = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded, not handled
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value
