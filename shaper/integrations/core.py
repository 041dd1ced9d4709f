"""What every trainer adapter shares: settings, the timeout policy, the bridges and the text routes.

An adapter (one module per framework; docs/integrations/README.md, "Add a trainer
adapter") keeps only its framework's glue: how the framework hands samples over and
takes rewards back. The policy is here, once, and imports no framework:

* :class:`AdapterSettings` — how long to wait for a verdict, what a late one does
  (:data:`ON_TIMEOUT`, one vocabulary for every adapter) and how process rewards
  become one scalar (:data:`REDUCTIONS`);
* :class:`VerdictTimeout` — the one "no verdict in time" error (``on_timeout="raise"``;
  the gateway answers 504 with its message), and :func:`settle`, which counts a group's
  statuses, reports them and applies the policy;
* :class:`LoopClient` (the one sync bridge: a client on an event loop in a daemon
  thread, :mod:`infra.event_loop`) and :class:`PerLoop` (one client per running loop);
* :func:`score_blocks` — a batch's consecutive blocks of one prompt scored as groups;
* :func:`score_groups`, :func:`openrlhf_scores`, :func:`slime_scores` — what the
  gateway's routes and the in-process OpenRLHF and slime hooks call, so a trainer gets
  the same tokens and numbers whichever way it comes;
* :func:`verdict_lookup` — verdicts by group id for a synchronous advantage step;
* small helpers: :func:`load_pipeline`, :func:`option`, :func:`shaping_with` / :func:`shaping_for`, :func:`resolved`,
  :func:`status_counts`, :func:`status_rates`, :func:`token_rows`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import uuid
import warnings
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from functools import lru_cache
from os import PathLike
from typing import Any, Final, Generic, Literal, TypeGuard, TypeVar

import msgspec
import numpy as np
import torch

from infra.config import ConfigError, GatewayConfig, PipelineConfig, PRMAdvantageShapingConfig, load_config
from infra.errors import TrainingError
from infra.event_loop import LoopClient
from shaper.errors import ShapingInputError, VerdictMismatch
from shaper.reward_client import BlockingVerdicts, ProcessReduction, RewardClient, Sample, SampleReward, reduce_process
from shaper.shaping import shape_advantages
from shaper.text_rewards import ByteTokenizer, FileTokenizer, load_tokenizer, openrlhf_answer, reward_summary

__all__ = [
    "DEPRECATED_ON_TIMEOUT",
    "ON_TIMEOUT",
    "REDUCTIONS",
    "AdapterSettings",
    "ConfigArg",
    "ConfigError",
    "LoopClient",
    "OnTimeout",
    "PerLoop",
    "ShapingInputError",
    "TextScorer",
    "VerdictMismatch",
    "VerdictTimeout",
    "check_late",
    "close_verdict_lookups",
    "groups_of",
    "load_pipeline",
    "openrlhf_scores",
    "option",
    "resolved",
    "score_blocks",
    "score_groups",
    "settle",
    "shaping_for",
    "shaping_with",
    "slime_scores",
    "status_counts",
    "status_rates",
    "token_rows",
    "verdict_lookup",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

ConfigArg = PipelineConfig | str | PathLike[str] | None
"""Where an adapter's pipeline config comes from: a config, a YAML path, or None for ``$PRM_CONFIG``."""

OnTimeout = Literal["outcome_only", "reject", "raise"]
ON_TIMEOUT: Final[tuple[OnTimeout, ...]] = ("outcome_only", "reject", "raise")
"""What a verdict that does not come in time does: the samples keep their outcome and get no
process rewards (``outcome_only``), the group is not trained on (``reject``), or
:class:`VerdictTimeout` stops the caller (``raise``). An adapter supports a subset."""

DEPRECATED_ON_TIMEOUT: Final[dict[str, str]] = {"record": "outcome_only"}
"""Names an adapter accepted before the shared vocabulary (verifiers' ``prm_on_timeout``)."""

REDUCTIONS: Final[tuple[str, ...]] = ("mean", "sum", "last")
PUBLISHED: Final = " (its trajectories are published; the workers may still decide it)"
_CONSEQUENCE: Final = {
    "outcome_only": "the samples keep their outcome and get no process rewards",
    "reject": "the group is rejected",
}


class VerdictTimeout(TrainingError, TimeoutError):
    """No verdict for a group within the adapter's wait (``on_timeout="raise"``; the gateway's 504)."""


class AdapterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An adapter's policy, checked when built.

    ``verdict_timeout_s``: the wait per group (``None``: the workers' ``group_timeout_s``
    + 30 s, so a group missing members is rejected by the workers before we give up).
    """

    on_timeout: OnTimeout = "outcome_only"
    reduction: ProcessReduction = "mean"
    verdict_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.on_timeout not in ON_TIMEOUT:
            raise ConfigError(f"on_timeout must be one of {_choices(ON_TIMEOUT)}, got {self.on_timeout!r}")
        if self.reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {_choices(REDUCTIONS)}, got {self.reduction!r}")
        if self.verdict_timeout_s is not None and not (
            math.isfinite(self.verdict_timeout_s) and self.verdict_timeout_s > 0
        ):
            raise ConfigError(f"verdict_timeout_s must be a positive number, got {self.verdict_timeout_s!r}")

    @classmethod
    def checked(
        cls,
        *,
        on_timeout: str = "outcome_only",
        reduction: str = "mean",
        verdict_timeout_s: float | None = None,
        supports: Sequence[str] = ON_TIMEOUT,
        key: str = "on_timeout",
    ) -> AdapterSettings:
        """Settings for an adapter that ``supports`` these policies; a deprecated name maps, with a warning."""
        if on_timeout in DEPRECATED_ON_TIMEOUT:
            new = DEPRECATED_ON_TIMEOUT[on_timeout]
            warnings.warn(f"{key}={on_timeout!r} is deprecated; it means {new!r}", DeprecationWarning, stacklevel=3)
            on_timeout = new
        if on_timeout not in supports or not _is_on_timeout(on_timeout):
            raise ConfigError(f"{key} must be one of {_choices(supports)}, got {on_timeout!r}")
        return cls(
            on_timeout=on_timeout,
            reduction=reduction,  # type: ignore[arg-type]
            verdict_timeout_s=None if verdict_timeout_s is None else float(verdict_timeout_s),
        )

    @classmethod
    def from_gateway(cls, gw: GatewayConfig) -> AdapterSettings:
        """The text routes' policy: ``gateway.*`` wait and reduction; a late verdict raises (HTTP: 504)."""
        return cls(on_timeout="raise", reduction=gw.process_reduction, verdict_timeout_s=gw.verdict_timeout_s)

    def client(self, cfg: PipelineConfig, decode: Callable[[np.ndarray], str] | None = None) -> RewardClient:
        return RewardClient(cfg, verdict_timeout_s=self.verdict_timeout_s, decode=decode)

    def scalar(self, reward: SampleReward) -> float:
        """outcome + the reduction of the process rewards (0 unless accepted): one number per sample."""
        return reward.outcome + reduce_process(reward, self.reduction)


def status_counts(rewards: Sequence[SampleReward]) -> tuple[int, int, int]:
    """``(accepted, late, all)`` of ``rewards``."""
    return sum(r.accepted for r in rewards), sum(r.status == "timeout" for r in rewards), len(rewards)


def status_rates(rewards: Sequence[SampleReward]) -> dict[str, float]:
    """``prm/accepted`` and ``prm/timeout``: the fractions of ``rewards`` accepted and late (trainer metrics)."""
    accepted, late, n = status_counts(rewards)
    return {"prm/accepted": accepted / max(n, 1), "prm/timeout": late / max(n, 1)}


def token_rows(rewards: Sequence[SampleReward], width: int) -> np.ndarray:
    """``[len(rewards), width]`` float32: each sample's process rewards from its first response token, cut or
    0-padded."""
    out = np.zeros((len(rewards), width), dtype=np.float32)
    for i, r in enumerate(rewards):
        out[i, : min(len(r.token_rewards), width)] = r.token_rewards[:width]
    return out


def shape_rows(
    advantages: torch.Tensor, rewards: Sequence[SampleReward], mask: torch.Tensor, shaping: Mapping[str, Any]
) -> torch.Tensor:
    """``(B, T)`` advantages: the ``(B,)`` outcome advantages shaped by each row's process rewards
    (``mask`` is ``(B, T)``; ``shaping`` is :func:`shape_advantages`' mode and coefficients)."""
    (b,), t = advantages.shape, mask.shape[-1]
    if len(rewards) != b:
        raise VerdictMismatch(f"{len(rewards)} process-reward rows for a batch of {b}")
    process = torch.from_numpy(token_rows(rewards, t)).to(advantages.device)
    return shape_advantages(advantages.unsqueeze(1).expand(b, t), process, mask.to(advantages.device), **shaping)


def _is_on_timeout(value: str) -> TypeGuard[OnTimeout]:
    return value in ON_TIMEOUT


def _choices(values: Sequence[str]) -> str:
    return ", ".join(repr(v) for v in values)


def check_late(rewards: Sequence[SampleReward], settings: AdapterSettings) -> SampleReward | None:
    """The first member without a verdict, or None; under ``raise`` a :class:`VerdictTimeout` naming its group."""
    late = next((r for r in rewards if r.status == "timeout"), None)
    if late is not None and settings.on_timeout == "raise":
        raise VerdictTimeout(late.reason + PUBLISHED)
    return late


def settle(
    rewards: Sequence[SampleReward], settings: AdapterSettings, counts: Counter[str] | None = None, *, who: str = "prm"
) -> bool:
    """Count the statuses, report, apply the timeout policy; True when a verdict was late.

    Under ``raise`` a late verdict is :class:`VerdictTimeout`; otherwise a warning says
    what happens and the caller does it (keep the outcome, or drop the group). A group
    the workers rejected or discarded is logged once.
    """
    if counts is not None:
        counts.update(r.status for r in rewards)
    late = check_late(rewards, settings)
    if late is not None:
        log.warning("%s: %s; %s", who, late.reason, _CONSEQUENCE[settings.on_timeout])
        return True
    refused = next((r for r in rewards if r.status in ("rejected", "discarded")), None)
    if refused is not None:
        log.info(
            "%s: group %s %s (%s: %s): no process rewards",
            who,
            refused.group_id,
            refused.status,
            refused.reason_code or "-",
            refused.reason,
        )
    return False


# --------------------------------------------------------------------------- clients and loops
class PerLoop(Generic[T]):
    """One value per running event loop and key, made by ``make()`` on first use.

    aiokafka's clients belong to the loop that made them, and a framework may score
    from several loops (a test's, a rollout thread's); each gets its own.
    """

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, T]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        values = self._by_loop.setdefault(asyncio.get_running_loop(), {})
        if key not in values:
            values[key] = make()
        return values[key]

    async def aclose(self) -> None:
        """Close (``aclose()``) and forget the current loop's values."""
        for value in self._by_loop.pop(asyncio.get_running_loop(), {}).values():
            await value.aclose()  # type: ignore[attr-defined]


def option(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b`` in a framework's nested config: OmegaConf ``DictConfig``, dataclasses and dicts alike."""
    node = config
    for key in dotted.split("."):
        if node is None:
            return default
        node = node.get(key) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, key, None)
    return default if node is None else node


_LOOKUPS: dict[tuple[str | None, float], BlockingVerdicts] = {}


def verdict_lookup(path: str | None, lookback_s: float) -> BlockingVerdicts:
    """The process's verdict lookup for the config at ``path`` (``$PRM_CONFIG``: None), started on first use."""
    key = (path, float(lookback_s))
    if key not in _LOOKUPS:
        _LOOKUPS[key] = BlockingVerdicts(load_config(path), lookback_s=key[1])
    return _LOOKUPS[key]


def close_verdict_lookups() -> None:
    """Stop the verdict lookups' consumers (tests and scripts; a trainer's driver just exits)."""
    while _LOOKUPS:
        _LOOKUPS.popitem()[1].close()


def load_pipeline(cfg: ConfigArg) -> PipelineConfig:
    """A config, or the YAML at a path, or ``$PRM_CONFIG`` for None."""
    return cfg if isinstance(cfg, PipelineConfig) else load_config(None if cfg is None else str(cfg))


async def resolved(value: T | Awaitable[T]) -> T:
    """``value``, awaited when a user's hook (sync or async) returned an awaitable."""
    return await value if inspect.isawaitable(value) else value


async def outcomes_of(
    outcome: Callable[..., Any] | None,
    prompts: Sequence[Any],
    completion_ids: Sequence[Any],
    columns: Mapping[str, Any],
) -> list[float]:
    """One outcome per completion from a user's reward function (sync or async; ``None``: all 0)."""
    n = len(completion_ids)
    if outcome is None:
        return [0.0] * n
    values = list(await resolved(outcome(prompts=prompts, completion_ids=completion_ids, **columns)))
    if len(values) != n:
        raise ShapingInputError(f"the outcome function returned {len(values)} values for {n} completions")
    return values


@lru_cache(maxsize=32)
def shaping_for(path: str | None, overrides: tuple[tuple[str, Any], ...], key: str) -> PRMAdvantageShapingConfig:
    """:func:`shaping_with` on the YAML at ``path``, checked once per distinct setting (not per batch)."""
    return shaping_with(load_config(path).prm.advantage_shaping, dict(overrides), key)


def shaping_with(
    base: PRMAdvantageShapingConfig, overrides: Mapping[str, Any] | None, key: str
) -> PRMAdvantageShapingConfig:
    """``base`` with ``overrides`` (mode, coefficients), checked as a loaded config is; ``key`` names the option."""
    known = set(base.__struct_fields__)
    unknown = set(overrides or {}) - known
    if unknown:
        raise ConfigError(f"{key}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        return msgspec.structs.replace(base, **dict(overrides or {}))
    except ValueError as exc:  # ConfigError: unknown mode, bad coefficient
        raise ConfigError(f"{key}: {exc}") from None


# --------------------------------------------------------------------------- the text routes
async def score_groups(
    client: RewardClient,
    groups: Sequence[Sequence[Sample]],
    *,
    prefix: str,
    observe: Callable[[SampleReward], None] | None = None,
) -> list[list[SampleReward]]:
    """Score each list of samples as one group (``<prefix>-<uuid>``), concurrently; ``observe`` sees every result."""
    scored = await asyncio.gather(
        *(client.score_group(list(g), group_id=f"{prefix}-{uuid.uuid4().hex}") for g in groups)
    )
    if observe is not None:
        for reward in (r for rs in scored for r in rs):
            observe(reward)
    return scored


def groups_of(n: int, group_size: int, keys: Sequence[Any]) -> list[range]:
    """The blocks of ``group_size`` consecutive rows that form a batch's groups, checked.

    Trainers that repeat each prompt ``group_size`` times in a row (TRL's RepeatSampler)
    hand groups over this way; a block whose ``keys`` (prompts) differ means the rows of
    one group are not all here — an error, not a silent regroup.
    """
    if group_size < 1:
        raise ConfigError(f"group_size must be >= 1, got {group_size}")
    if n % group_size:
        raise ConfigError(
            f"{n} completions do not split into groups of {group_size}: make the per-device batch "
            "a multiple of num_generations so every group is scored by one process"
        )
    blocks = [range(i, i + group_size) for i in range(0, n, group_size)]
    for block in blocks:
        if any(keys[i] != keys[block.start] for i in block):
            raise ShapingInputError(
                f"rows {block.start}..{block.stop - 1} should be {group_size} completions of one prompt "
                "but their prompts differ: TRL's RepeatSampler layout is required"
            )
    return blocks


async def score_blocks(
    client: RewardClient,
    samples: Sequence[Sample],
    keys: Sequence[Any],
    group_size: int,
    settings: AdapterSettings,
    counts: Counter[str] | None = None,
    *,
    prefix: str,
) -> list[SampleReward]:
    """Each block of :func:`groups_of` scored as one group, then settled (:func:`settle`); results in sample order."""
    blocks = groups_of(len(samples), group_size, keys)
    scored = await score_groups(client, [[samples[i] for i in b] for b in blocks], prefix=prefix)
    rewards = [r for group in scored for r in group]
    settle(rewards, settings, counts, who=prefix)
    return rewards


async def openrlhf_scores(
    client: RewardClient,
    gw: GatewayConfig,
    samples: Sequence[Sample],
    *,
    prefix: str = "openrlhf",
    observe: Callable[[SampleReward], None] | None = None,
) -> dict[str, Any]:
    """OpenRLHF's remote-RM answer for its queries (``POST /openrlhf`` and the ``.py`` hook).

    Grouping (``gateway.grouping``) and the scalar (``gateway.process_reduction``) are the
    config's; no verdict in time is :class:`VerdictTimeout` naming the group.
    """
    settings = AdapterSettings.from_gateway(gw)
    groups = [samples] if gw.grouping == "per_request" else [[s] for s in samples]
    scored = await score_groups(client, groups, prefix=prefix, observe=observe)
    for rewards in scored:
        check_late(rewards, settings)
    return openrlhf_answer([reward_summary(r, settings.reduction) for rs in scored for r in rs])


async def slime_scores(
    client: RewardClient,
    gw: GatewayConfig,
    samples: Sequence[Sample],
    *,
    prefix: str = "slime",
    observe: Callable[[SampleReward], None] | None = None,
) -> list[dict[str, Any]]:
    """slime's answers for one group (``POST /slime`` and the custom reward): the summary plus
    ``token_rewards`` and ``turn_rewards`` per sample; no verdict in time is :class:`VerdictTimeout`."""
    settings = AdapterSettings.from_gateway(gw)
    (rewards,) = await score_groups(client, [samples], prefix=prefix, observe=observe)
    check_late(rewards, settings)
    return [
        {
            **reward_summary(r, settings.reduction),
            "token_rewards": r.token_rewards.tolist(),
            "turn_rewards": r.turn_rewards,
        }
        for r in rewards
    ]


class TextScorer:
    """The gateway's text setup in process: config, its tokenizer, a client with its wait."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.tokenizer: ByteTokenizer | FileTokenizer = load_tokenizer(cfg.gateway.tokenizer)
        self.client = AdapterSettings.from_gateway(cfg.gateway).client(cfg, decode=self.tokenizer.decode)

    @classmethod
    async def started(cls, cfg: PipelineConfig) -> TextScorer:
        """Made and connected on the running loop (the clients belong to it)."""
        scorer = cls(cfg)
        await scorer.client.start()
        return scorer

    async def aclose(self) -> None:
        await self.client.aclose()
