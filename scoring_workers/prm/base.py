"""The scorer contract (AReaL's Process Rewards, "Scorer Contract"), under AReaL's names.

A scorer turns one turn (or one branch) into an **unweighted** reward: a scalar that
the runner broadcasts over the turn's output tokens, or a dense tensor of shape
``[interaction.model_response.output_len]``. Weighting, summing across scorers,
validation and metrics are the runner's job, so a scorer stays a small, testable
coroutine. Rewards are unweighted so that the same scorer class can be reused at any
weight (including 0, which keeps its monitoring observations but removes its signal).

``None`` (or an exception) rejects the trajectory: a judge that could not decide must
not silently become a zero. A deliberate zero is ``0.0``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from infra.config import ConfigError
from infra.schema import PRMMetricObservation

if TYPE_CHECKING:
    import numpy as np
    import torch

    from infra.config import PRMConfig
    from scoring_workers.prm.view import InteractionView

    RawReward = float | int | torch.Tensor | np.ndarray
else:
    RawReward = Any

__all__ = ["BaseScorer", "BaseTrajectoryScorer", "PRMScorerResult", "RawReward"]


@dataclass(frozen=True, slots=True)
class PRMScorerResult:
    """A reward plus structured, unweighted monitoring observations.

    ``reward`` is what :meth:`BaseScorer.evaluate` would return (scalar or tensor of
    shape ``[output_len]``); ``observations`` are turned into
    ``prm_metric/<scope>/<scorer>/<metric>/<aggregation>`` statistics by the runner.
    """

    reward: RawReward
    observations: tuple[PRMMetricObservation, ...] = ()

    def __post_init__(self) -> None:
        if self.reward is None:
            raise TypeError(
                "PRMScorerResult.reward must not be None: return None from evaluate() to "
                "reject the trajectory, or 0.0 for a deliberate zero"
            )
        observations = self.observations
        if not isinstance(observations, tuple):
            if isinstance(observations, (str, bytes)) or not isinstance(observations, Iterable):
                raise TypeError("PRMScorerResult.observations must be a sequence of PRMMetricObservation")
            observations = tuple(observations)
            object.__setattr__(self, "observations", observations)
        for item in observations:
            if not isinstance(item, PRMMetricObservation):
                raise TypeError(
                    f"PRMScorerResult.observations must contain PRMMetricObservation, got {type(item).__name__}"
                )


class BaseScorer:
    """Base class of every per-turn scorer.

    Subclasses set a non-empty class-level :attr:`name` (it keys metrics, scorer
    totals and the observation schema) and implement :meth:`evaluate`. Two scorers may
    share a name (e.g. one class twice with different kwargs), as in AReaL: both run,
    their contributions add up and they share the name's metrics and schema.
    Constructor keyword arguments beyond ``weight``/``enabled`` come from the
    config's ``kwargs``; declare them explicitly so a typo fails at start-up.

    Scorers may be shared by concurrent sessions: keep per-request state inside the
    coroutine, never on ``self``. External calls should use async clients with
    bounded timeouts and retries; resources they own are released in :meth:`aclose`.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    """Recorded next to :attr:`name` in verdicts; bump it when scores change meaning."""
    deterministic: ClassVar[bool] = True
    """Same inputs give the same rewards; ``prm-pipeline audit`` re-scores only these
    (set False for sampling judges: the audit checks their recorded results instead)."""
    record_settings: ClassVar[type[Any] | None] = None
    """The constructor arguments an experiment-registry record may set: a
    :class:`~scoring_workers.prm.capabilities.RecordSettings` struct (typed, bounded).
    ``None``: records may set none (only ``weight``/``enabled``); everything else comes
    from the operator's own config (our extension; docs/security.md)."""
    operator_only: ClassVar[Mapping[str, str]] = {}
    """Why each operator-only argument is one ("loads code", "reads the environment"...),
    quoted when a record tries to set it."""
    weight: float
    enabled: bool
    streamable: ClassVar[bool] = False
    """Declares that a turn's result depends on nothing but the turn, its next state (as
    found in ``ctx["messages"]``, see :meth:`stream_key`) and the session's identity
    (``ctx["session_id"]``, ``ctx["trajectory_id"]``). A worker scoring a *streamed*
    session (docs/wire.md, "Streamed sessions") may then run it on turn *t* as soon as
    *t*'s next state has arrived, long before the session ends, with ``ctx["messages"]``
    the conversation up to and including that next state, ``ctx["leaf_id"]`` the turn
    that brought it and no ``ctx["is_eval"]`` (not known before the end). False (the
    default, and every third-party scorer that does not declare it): the scorer runs at
    the session's end with the whole branch, exactly as for a ``ready`` session. Our
    extension; AReaL scores whole trajectories only."""

    def stream_key(self, interaction: InteractionView, ctx: dict[str, Any]) -> object:
        """What a :attr:`streamable` scorer's result for ``interaction`` reads of
        ``ctx["messages"]``, as a value that compares equal when the result would be the
        same (None: nothing). A worker reuses a result computed on a streamed turn for a
        branch of the ended session only when the branch's conversation gives an equal
        key, and scores the turn again otherwise: so a streamed session's verdict is the
        ``ready`` form's even when the agent rewrote its history between turns."""
        return None

    def __init__(self, weight: float = 1.0, enabled: bool = True) -> None:
        cls = type(self)
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{cls.__qualname__} must set a non-empty class-level `name`")
        version = getattr(cls, "version", None)
        if not isinstance(version, str) or not version:
            raise ConfigError(f"{cls.__qualname__}.version must be a non-empty string")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"scorer {name!r}: weight must be a number, got {weight!r}")
        if not math.isfinite(float(weight)):
            raise ConfigError(f"scorer {name!r}: weight must be finite, got {weight!r}")
        if not isinstance(enabled, bool):
            raise TypeError(f"scorer {name!r}: enabled must be a bool, got {enabled!r}")
        self.weight = float(weight)
        self.enabled = enabled

    async def evaluate(self, interaction: InteractionView, ctx: dict[str, Any]) -> RawReward | None:
        """Return the turn's unweighted reward (scalar or ``[output_len]`` tensor), or
        ``None`` to reject the trajectory."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement evaluate(interaction, ctx)")

    def prepare_result(
        self, interaction: InteractionView, result: RawReward | PRMScorerResult | None, ctx: dict[str, Any]
    ) -> PRMScorerResult | None:
        """Wrap a raw reward into :class:`PRMScorerResult`.

        Override to attach observations computed from the raw result. ``None`` passes
        through (the runner counts it as a rejection); a :class:`PRMScorerResult`
        passes through unchanged.
        """
        if result is None or isinstance(result, PRMScorerResult):
            return result
        return PRMScorerResult(result)

    async def evaluate_result(self, interaction: InteractionView, ctx: dict[str, Any]) -> PRMScorerResult | None:
        """:meth:`evaluate`, then :meth:`prepare_result` only if the result is not None
        (as in AReaL: ``None`` rejects right here, so ``prepare_result`` never sees it);
        this is what the runner calls."""
        result = await self.evaluate(interaction, ctx)
        if result is None:
            return None
        return self.prepare_result(interaction, result, ctx)

    def validate_prm_config(self, config: PRMConfig, *, training_enabled: bool) -> Awaitable[None] | None:
        """Optional start-up check, called once by the runner for every scorer.

        ``training_enabled`` is False for disabled scorers (and when the whole PRM block
        is disabled), so a scorer can skip checks that only matter when it scores. May
        be a coroutine function; raise to refuse the configuration.
        """
        return None

    async def aclose(self) -> None:
        """Release resources this scorer owns (clients, background writers).

        The default does nothing. Bound external I/O here yourself: the runner adds
        no timeout or retry around it.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(name={self.name!r}, weight={self.weight!r}, enabled={self.enabled!r})"


class BaseTrajectoryScorer(BaseScorer):
    """A scorer that sees a whole branch at once (joint scoring of the conversation).

    The runner calls :meth:`evaluate_trajectory` once per root-to-leaf branch with its
    turns parent-before-child. It returns a mapping ``interaction_id -> unweighted
    reward`` (anything else: ``TypeError``); ids it leaves out score ``0.0``; unknown or
    ``None`` ids are ``ValueError``; a ``None`` reward rejects the trajectory.
    Each value passes through :meth:`prepare_result`, so observations work as for
    per-turn scorers.
    """

    async def evaluate(self, interaction: InteractionView, ctx: dict[str, Any]) -> RawReward | None:
        raise RuntimeError(
            f"{type(self).__qualname__} is a trajectory scorer: the runner calls "
            "evaluate_trajectory(interactions, ctx) once per branch, never evaluate()"
        )

    async def evaluate_trajectory(
        self, interactions: Sequence[InteractionView], ctx: dict[str, Any]
    ) -> Mapping[str, RawReward | PRMScorerResult | None] | None:
        """Return ``{interaction_id: reward}`` for the branch ``interactions`` (root first)."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement evaluate_trajectory(interactions, ctx)")
