"""``PRMRunner``: scores one ready trajectory with the configured scorers.

What a run does, and why it is shaped this way (seed 001, "Scorer Contract",
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
   observations, metric schema — and only then committed (weighted by the scorer's
   weight and added to the branch's token rewards). ``None`` or an exception anywhere
   rejects the trajectory with :class:`PRMRejection`: the first exception in turn
   order wins, else the count of ``None`` turns is reported.
5. A :class:`ScoredTrajectory` exists only if every branch succeeded; metric schemas
   seen in the run are bound to their scorer only then.

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
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from types import CoroutineType
from typing import Any

import msgspec
import numpy as np
import torch

from infra.config import ConfigError, PRMConfig, validate_prm
from infra.schema import PRMMetricObservation, PRMTurnResult, ScorerInfo, TokenRewards
from infra.tree import TreeError, branches
from scoring_workers.prm.base import BaseScorer, BaseTrajectoryScorer, PRMScorerResult
from scoring_workers.prm.resolve import build_scorer
from scoring_workers.prm.results import (
    SCORER_REASON_PATTERN,
    PRMRejection,
    RunnerClosedError,
    ScoredBranch,
    ScoredTrajectory,
)
from scoring_workers.prm.view import InteractionView, MessageCache

__all__ = ["PRMRunner"]

log = logging.getLogger(__name__)

_F32_MAX = float(np.finfo(np.float32).max)
_MISSING = object()

# (value_type, aggregations as a set): order of aggregations is not part of the schema.
_Schema = tuple[str, frozenset[str]]
_SchemaTable = dict[tuple[str, str], _Schema]  # (scope, metric_id) -> schema


_AGG_SETS: dict[tuple[str, ...], frozenset[str]] = {}


def _agg_set(aggregations: tuple[str, ...]) -> frozenset[str]:
    found = _AGG_SETS.get(aggregations)
    if found is None:  # at most a handful of distinct tuples exist (count/rate/sum/mean)
        found = _AGG_SETS[aggregations] = frozenset(aggregations)
    return found


class _Invalid(Exception):
    """Internal: a scorer result broke a rule; becomes a :class:`PRMRejection`."""

    def __init__(self, message: str, reason: str = "invalid_reward") -> None:
        super().__init__(message)
        self.reason = reason


class _Resume:
    """Await a coroutine whose first step was already run by hand.

    Driving a coroutine with ``coro.send(None)`` tells whether it finishes without
    suspending (LengthBudgetScorer and most rule-based scorers do); then no task is
    created at all. A coroutine that did suspend is finished *in the same task* through
    this object, which forwards every later send/throw exactly as ``await`` would
    (PEP 380), so ``asyncio.timeout()``, contextvars and cancellation inside the scorer
    see one consistent task.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self):
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


async def _as_coroutine(awaitable: Any, scorer_name: str) -> Any:
    """Accept any awaitable from ``evaluate_result`` (a coroutine is the norm)."""
    if not inspect.isawaitable(awaitable):
        raise TypeError(
            f"scorer {scorer_name!r}: evaluate_result() must be async (returned {type(awaitable).__name__})"
        )
    return await awaitable


def _coroutine(result: Any, scorer_name: str) -> Coroutine[Any, Any, Any]:
    return result if type(result) is CoroutineType else _as_coroutine(result, scorer_name)


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
        raise _Invalid(f"output_len is {output_len}; a scored turn needs at least one output token")
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
                raise _Invalid(f"reward {type(raw).__name__} is not numeric: {exc}") from None
        else:
            raise _Invalid(
                f"reward must be a number or a tensor of shape [{output_len}], got {type(raw).__name__}"
            )
        if tensor.is_complex() or tensor.dtype not in _REAL_DTYPES:
            raise _Invalid(f"reward tensor has unsupported dtype {tensor.dtype}")
        if tensor.dim() == 0:
            value = float(tensor.item())
        else:
            if tuple(tensor.shape) != (output_len,):
                raise _Invalid(f"reward tensor has shape {list(tensor.shape)}, expected [{output_len}] (output_len)")
            tensor = tensor.to(device="cpu", dtype=torch.float32)
            if not bool(torch.isfinite(tensor).all()):
                raise _Invalid("reward tensor has non-finite values (in float32)")
            weighted = tensor * weight
            if not bool(torch.isfinite(weighted).all()):
                raise _Invalid(f"weighted reward tensor (weight {weight}) has non-finite values in float32")
            return weighted, float(weighted.mean())
    if not math.isfinite(value):
        raise _Invalid(f"reward {value!r} is not finite")
    weighted_value = value * weight
    if not math.isfinite(weighted_value) or abs(weighted_value) > _F32_MAX:
        raise _Invalid(f"weighted reward {value!r} * {weight!r} is not finite in float32")
    weighted_value = _to_f32(weighted_value)
    return weighted_value, weighted_value


_REAL_DTYPES = frozenset(
    {
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
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


def _finish(acc: float | torch.Tensor, output_len: int) -> TokenRewards | torch.Tensor:
    """A turn's final rewards: compact uniform form for scalar-only turns (see ScoredBranch).

    Each contribution was checked finite on its own; their *sum* can still overflow
    float32, which is refused like any other non-finite reward.
    """
    if isinstance(acc, float):
        if not abs(acc) <= _F32_MAX:
            raise _Invalid(f"summed token reward {acc!r} is not finite in float32")
        return TokenRewards(length=output_len, uniform=_to_f32(acc))
    if not bool(torch.isfinite(acc).all()):
        raise _Invalid("summed token rewards are not finite in float32")
    return acc


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
            try:
                config = msgspec.convert(dict(config), PRMConfig, strict=False)
            except msgspec.ValidationError as exc:
                raise ConfigError(f"invalid PRM config: {exc}") from None
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
        seen: set[str] = set()
        for scorer in self._scorers:
            name = getattr(type(scorer), "name", None)
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"{type(scorer).__qualname__} must set a non-empty class-level `name`")
            if not hasattr(scorer, "weight") or not hasattr(scorer, "enabled"):
                raise TypeError(f"scorer {name!r}: its __init__ must call BaseScorer.__init__")
            if name.endswith("__count"):
                raise ValueError(f"scorer name {name!r} must not end with '__count' (reserved by metrics)")
            if name in seen:
                raise ValueError(
                    f"two scorers are named {name!r}; names key metrics and totals and must be unique "
                    "within a runner (subclass and set another `name`)"
                )
            seen.add(name)
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
            except Exception as cleanup:  # collected onto the original error
                log.error("PRM start-up rollback: closing scorer %r failed", scorer.name, exc_info=cleanup)
                error.add_note(
                    f"while rolling back PRMRunner.create(): {scorer.name}.aclose() failed: {cleanup!r}"
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

        Raises:
            PRMRejection: the trajectory is rejected (see its ``reason``).
            RunnerClosedError: :meth:`aclose` has started.
        """
        if self._closing:
            raise RunnerClosedError("PRMRunner is closing or closed; run() is no longer accepted")
        self._inflight += 1
        try:
            return await self._run(trajectory, is_eval, ctx, keep_channels)
        finally:
            self._inflight -= 1

    async def _run(
        self, trajectory: Any, is_eval: bool | None, ctx: Mapping[str, Any] | None, keep_channels: bool = False
    ) -> ScoredTrajectory:
        trajectory_id = trajectory.trajectory_id
        if is_eval is None:
            is_eval = bool(getattr(trajectory, "is_eval", False))
        interactions = trajectory.interactions
        for interaction in interactions:
            if interaction.model_response is None:
                raise PRMRejection(
                    f"trajectory {trajectory_id!r}: interaction {interaction.interaction_id!r} has no "
                    "model_response; PRM scoring needs token-backed interactions",
                    reason="not_token_backed",
                    interaction_id=interaction.interaction_id,
                    trajectory_id=trajectory_id,
                )
        try:
            paths = branches(interactions)
        except TreeError as exc:
            raise PRMRejection(
                f"trajectory {trajectory_id!r}: {exc}", reason="invalid_trajectory", trajectory_id=trajectory_id
            ) from exc
        base_ctx = dict(ctx) if ctx else {}
        base_ctx["is_eval"] = is_eval
        base_ctx["trajectory_id"] = trajectory_id
        base_ctx["session_id"] = trajectory.session_id
        cache: MessageCache = {}
        pending: dict[str, _SchemaTable] = {}
        scored = [
            await self._score_branch(path, base_ctx, cache, pending, trajectory_id, keep_channels) for path in paths
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
    ) -> ScoredBranch:
        views: list[InteractionView] = []
        parent = None
        for interaction in path:
            parent = InteractionView(interaction, parent, cache)
            views.append(parent)
        leaf = views[-1]
        leaf_id = leaf.interaction_id
        ctx = dict(base_ctx)
        ctx["leaf_id"] = leaf_id
        ctx["messages"] = leaf.messages + leaf.output_message_list if self._active else ()
        lengths = [view.model_response.output_len for view in views]
        acc: list[float | torch.Tensor] = [0.0] * len(views)
        turn_results: list[PRMTurnResult] = []
        totals: dict[str, float] = {}
        channels: dict[str, dict[str, TokenRewards | torch.Tensor]] = {}
        for scorer in self._active:
            where = {"scorer_name": scorer.name, "leaf_id": leaf_id, "trajectory_id": trajectory_id}
            if isinstance(scorer, BaseTrajectoryScorer):
                outcomes = await self._evaluate_branch(scorer, views, ctx, where)
            else:
                outcomes = await self._evaluate_turns(scorer, views, ctx, where)
            # Validate everything this scorer produced before committing any of it.
            staged: list[tuple[float | torch.Tensor, float, tuple[PRMMetricObservation, ...]]] = []
            for view, output_len, outcome in zip(views, lengths, outcomes):
                try:
                    value, reward = _weighted(outcome, scorer.weight, output_len)
                except _Invalid as exc:
                    raise PRMRejection(
                        f"scorer {scorer.name!r}, interaction {view.interaction_id!r}: {exc}",
                        reason=exc.reason, interaction_id=view.interaction_id, **where,
                    ) from None
                observations = outcome.observations if isinstance(outcome, PRMScorerResult) else ()
                staged.append((value, reward, observations))
            schema = self._check_observations(scorer.name, views, staged, pending, where)
            # Commit.
            if schema:
                pending.setdefault(scorer.name, {}).update(schema)
            total = 0.0
            name = scorer.name
            channel: dict[str, TokenRewards | torch.Tensor] | None = {} if keep_channels else None
            for i, (value, reward, observations) in enumerate(staged):
                if channel is not None:
                    # _accumulate adds in place into its tensors: the channel keeps the
                    # original, the running sum gets a copy.
                    if isinstance(value, float):
                        channel[views[i].interaction_id] = TokenRewards(length=lengths[i], uniform=value)
                    else:
                        channel[views[i].interaction_id] = value
                        value = value.clone()
                acc[i] = _accumulate(acc[i], value)
                turn_results.append(
                    PRMTurnResult(
                        interaction_id=views[i].interaction_id, scorer_name=name, reward=reward,
                        observations=observations,
                    )
                )
                total += reward
            totals[name] = total
            if channel is not None:
                channels[name] = channel
        token_rewards: dict[str, TokenRewards | torch.Tensor] = {}
        for view, output_len, a in zip(views, lengths, acc):
            try:
                token_rewards[view.interaction_id] = _finish(a, output_len)
            except _Invalid as exc:
                raise PRMRejection(
                    f"interaction {view.interaction_id!r}: {exc}", reason=exc.reason,
                    interaction_id=view.interaction_id, leaf_id=leaf_id, trajectory_id=trajectory_id,
                ) from None
        return ScoredBranch(
            leaf_id=leaf_id,
            path=list(token_rewards),
            token_rewards=token_rewards,
            scorer_totals=totals,
            turn_results=turn_results,
            channels=channels,
        )

    async def _evaluate_turns(
        self, scorer: BaseScorer, views: list[InteractionView], ctx: dict[str, Any], where: dict[str, Any]
    ) -> list[Any]:
        """Evaluate every turn; return results in turn order or raise the rejection.

        Turns are started in order and driven inline until one suspends; from then on
        the suspended turn is finished in this task while the remaining turns run as
        concurrent tasks. Synchronous scorers thus cost no task per turn, and judges
        still overlap their requests.
        """
        n = len(views)
        outcomes: list[Any] = [None] * n
        i = 0
        while i < n:
            coro = _coroutine(scorer.evaluate_result(views[i], dict(ctx)), scorer.name)
            try:
                first = coro.send(None)
            except StopIteration as stop:
                outcomes[i] = stop.value
                i += 1
                continue
            except Exception as exc:  # every earlier turn succeeded: first in order
                raise self._scorer_error(exc, views[i], where) from exc
            except asyncio.CancelledError as exc:
                if _runner_cancelled():
                    raise
                raise self._scorer_error(exc, views[i], where) from exc
            rest = [
                asyncio.ensure_future(_coroutine(scorer.evaluate_result(views[j], dict(ctx)), scorer.name))
                for j in range(i + 1, n)
            ]
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
                raise self._scorer_error(outcome, view, where) from outcome
            if outcome is None:
                nones += 1
        if nones:
            raise PRMRejection(
                f"scorer {scorer.name!r} returned None for {nones} of {n} turns of branch {where['leaf_id']!r} "
                "(None rejects the trajectory; return 0.0 for a deliberate zero)",
                reason="scorer_returned_none", **where,
            )
        return outcomes

    async def _evaluate_branch(
        self, scorer: BaseTrajectoryScorer, views: list[InteractionView], ctx: dict[str, Any], where: dict[str, Any]
    ) -> list[Any]:
        """Call ``evaluate_trajectory`` once; map its answer onto the branch's turns."""
        try:
            answer = await scorer.evaluate_trajectory(list(views), dict(ctx))
        except Exception as exc:
            raise self._scorer_error(exc, None, where) from exc
        except asyncio.CancelledError as exc:
            if _runner_cancelled():
                raise
            raise self._scorer_error(exc, None, where) from exc
        if answer is None:
            raise PRMRejection(
                f"trajectory scorer {scorer.name!r} returned None for branch {where['leaf_id']!r}",
                reason="scorer_returned_none", **where,
            )
        if isinstance(answer, Mapping):
            items: Iterable[Any] = answer.items()
        elif isinstance(answer, (str, bytes)) or not isinstance(answer, Iterable):
            raise PRMRejection(
                f"trajectory scorer {scorer.name!r} must return a mapping interaction_id -> reward, "
                f"got {type(answer).__name__}",
                reason="invalid_reward", **where,
            )
        else:
            items = answer
        index = {view.interaction_id: i for i, view in enumerate(views)}
        values: list[Any] = [_MISSING] * len(views)
        for item in items:
            try:
                key, value = item
            except (TypeError, ValueError):
                raise PRMRejection(
                    f"trajectory scorer {scorer.name!r}: expected (interaction_id, reward) pairs, got {item!r}",
                    reason="invalid_reward", **where,
                ) from None
            if not isinstance(key, str):
                raise PRMRejection(
                    f"trajectory scorer {scorer.name!r} returned the id {key!r}; ids must be interaction id strings",
                    reason="invalid_reward", **where,
                )
            i = index.get(key)
            if i is None:
                raise PRMRejection(
                    f"trajectory scorer {scorer.name!r} returned unknown interaction id {key!r} "
                    f"(branch {where['leaf_id']!r} has {list(index)})",
                    reason="invalid_reward", interaction_id=key, **where,
                )
            if values[i] is not _MISSING:
                raise PRMRejection(
                    f"trajectory scorer {scorer.name!r} returned interaction id {key!r} twice",
                    reason="invalid_reward", interaction_id=key, **where,
                )
            values[i] = value
        nones = sum(1 for value in values if value is None)
        if nones:
            raise PRMRejection(
                f"trajectory scorer {scorer.name!r} returned None for {nones} of {len(views)} turns of "
                f"branch {where['leaf_id']!r} (return 0.0 for a deliberate zero, or leave the id out)",
                reason="scorer_returned_none", **where,
            )
        outcomes: list[Any] = []
        for view, value in zip(views, values):
            if value is _MISSING:
                outcomes.append(0.0)
                continue
            try:
                prepared = scorer.prepare_result(view, value, dict(ctx))
            except Exception as exc:
                raise self._scorer_error(exc, view, where) from exc
            if prepared is None:
                raise PRMRejection(
                    f"trajectory scorer {scorer.name!r}: prepare_result returned None for {view.interaction_id!r}",
                    reason="scorer_returned_none", interaction_id=view.interaction_id, **where,
                )
            outcomes.append(prepared)
        return outcomes

    @staticmethod
    def _scorer_error(exc: BaseException, view: InteractionView | None, where: dict[str, Any]) -> PRMRejection:
        at = f", interaction {view.interaction_id!r}" if view is not None else f", branch {where['leaf_id']!r}"
        declared = getattr(exc, "reason", None)
        reason = declared if isinstance(declared, str) and SCORER_REASON_PATTERN.fullmatch(declared) else "scorer_error"
        return PRMRejection(
            f"scorer {where['scorer_name']!r} raised {type(exc).__name__}{at}: {exc}",
            reason=reason,
            interaction_id=None if view is None else view.interaction_id,
            **where,
        )

    def _check_observations(
        self,
        scorer_name: str,
        views: list[InteractionView],
        staged: list[tuple[Any, float, tuple[PRMMetricObservation, ...]]],
        pending: dict[str, _SchemaTable],
        where: dict[str, Any],
    ) -> _SchemaTable:
        """Validate one scorer's observations for one branch; return its new schema entries.

        A turn observation must target its own turn; (scope, target, metric) may occur
        once per scorer and branch (a shared ancestor is observed once per branch, like
        its reward); a metric's (value_type, aggregations) must match what this scorer
        used before — in this run or any earlier successful run.
        """
        seen: set[tuple[str, str, str]] = set()
        local: _SchemaTable = {}
        bound = self._schemas.get(scorer_name, {})
        mine = pending.get(scorer_name, {})
        for view, (_value, _reward, observations) in zip(views, staged):
            for obs in observations:
                if not isinstance(obs, PRMMetricObservation):
                    raise PRMRejection(
                        f"scorer {scorer_name!r}: observations must be PRMMetricObservation, got {type(obs).__name__}",
                        reason="invalid_observation", interaction_id=view.interaction_id, **where,
                    )
                if not isinstance(obs.target_id, str) or not obs.target_id:
                    raise PRMRejection(
                        f"scorer {scorer_name!r}: observation {obs.metric_id!r} has an empty target_id",
                        reason="invalid_observation", interaction_id=view.interaction_id, **where,
                    )
                if obs.scope == "turn" and obs.target_id != view.interaction_id:
                    raise PRMRejection(
                        f"scorer {scorer_name!r}: turn observation {obs.metric_id!r} on interaction "
                        f"{view.interaction_id!r} targets {obs.target_id!r}; a turn observation must "
                        "target its own interaction",
                        reason="invalid_observation", interaction_id=view.interaction_id, **where,
                    )
                key = (obs.scope, obs.target_id, obs.metric_id)
                if key in seen:
                    raise PRMRejection(
                        f"scorer {scorer_name!r}: duplicate {obs.scope} observation {obs.metric_id!r} "
                        f"for target {obs.target_id!r}",
                        reason="invalid_observation", interaction_id=view.interaction_id, **where,
                    )
                seen.add(key)
                schema_key = (obs.scope, obs.metric_id)
                schema: _Schema = (obs.value_type, _agg_set(obs.aggregations))
                known = local.get(schema_key) or mine.get(schema_key) or bound.get(schema_key)
                if known is not None and known != schema:
                    raise PRMRejection(
                        f"scorer {scorer_name!r}: {obs.scope} metric {obs.metric_id!r} changed schema from "
                        f"{known[0]} {sorted(known[1])} to {schema[0]} {sorted(schema[1])}; a metric's "
                        "value type and aggregations must stay stable",
                        reason="invalid_observation", interaction_id=view.interaction_id, **where,
                    )
                local[schema_key] = schema
        return local

    def _bind_schemas(self, pending: dict[str, _SchemaTable], trajectory_id: str) -> None:
        """Bind the run's metric schemas, re-checked here because concurrent runs may
        have bound the same metric meanwhile (no await between check and bind)."""
        for scorer_name, table in pending.items():
            bound = self._schemas.get(scorer_name, {})
            for schema_key, schema in table.items():
                known = bound.get(schema_key)
                if known is not None and known != schema:
                    raise PRMRejection(
                        f"scorer {scorer_name!r}: {schema_key[0]} metric {schema_key[1]!r} changed schema from "
                        f"{known[0]} {sorted(known[1])} to {schema[0]} {sorted(schema[1])} (concurrent run)",
                        reason="invalid_observation", scorer_name=scorer_name, trajectory_id=trajectory_id,
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
                except Exception as exc:  # collected and raised together below
                    log.error("PRM scorer %r failed to close", scorer.name, exc_info=exc)
                    errors.append(exc)
        except BaseException:
            self._close_done = True
            if remaining:
                log.warning(
                    "PRMRunner.aclose() interrupted; scorers left unclosed: %s", [s.name for s in remaining]
                )
            future.cancel()
            raise
        self._close_done = True
        if errors:
            group = ExceptionGroup(f"PRMRunner.aclose(): {len(errors)} scorer(s) failed to close", errors)
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
