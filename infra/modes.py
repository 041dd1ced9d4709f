"""The one registry of shaping modes: every list of mode names and every dispatch reads it.

Two families share it. ``advantage`` modes are the values of AReaL's
``rollout.agent.prm.advantage_shaping.mode``: their *kernel* folds a per-token process
signal into outcome advantages (:func:`shaper.shape_advantages`). ``combined`` modes
are ``trainer.combined_mode`` values: their *combiner* builds the per-token signal
from two scorers' channels (:mod:`shaper.combiners`), which an advantage mode then
folds in, or yields the advantage itself.

Config validation (:mod:`infra.config`), the CLI's choices, ``shape_batch``, the verl
adapter and the mode table in docs/trainer.md all read this table. Adding a mode is
one :func:`register` call with its :class:`Mode` entry and its implementation; nothing
else needs an edit. Implementations are referenced lazily (``"module:attribute"``)
because ``infra`` must stay importable without torch; a callable works as well.

Coefficients, their defaults and their rule (finite, ``>= 0``) live here too, as do the
names of the built-in judge and OPD scorers that the combined modes read by default.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from infra.errors import ConfigError

__all__ = [
    "COEFFICIENT_DEFAULTS",
    "COMBINED_MODES",
    "JUDGE_SCORER",
    "OPD_SCORER",
    "RECIPES",
    "SHAPING_MODES",
    "Mode",
    "check_coefficient",
    "combined_mode",
    "mode_info",
    "mode_table",
    "register",
    "registered_modes",
    "shaping_mode",
    "unregister",
]

JUDGE_SCORER: Final[str] = "openclaw_judge"
"""Name of the built-in OpenClaw-RL PRM judge scorer (``trainer.judge_scorer``'s default)."""
OPD_SCORER: Final[str] = "opd_teacher"
"""Name of the built-in OPD teacher scorer (``trainer.opd_scorer``'s default)."""

COEFFICIENT_DEFAULTS: Final[Mapping[str, float]] = {
    "negative_scale": 0.2,
    "zero_penalty": 0.4,
    "zero_eps": 1e-6,
}
"""``advantage_shaping`` coefficients and AReaL's defaults; a mode takes a subset."""

RECIPES: Final[tuple[str, ...]] = ("grpo", "openclaw_turns")
"""``trainer.recipe`` values: ``grpo`` (outcome advantage + shaped process rewards) and
``openclaw_turns`` (OpenClaw-RL's turn samples, :mod:`shaper.openclaw_recipe`)."""

Family = Literal["advantage", "combined"]


@dataclass(frozen=True, slots=True)
class Mode:
    """One mode: its implementation and the configuration rules that depend on it.

    ``implementation`` for an ``advantage`` mode is a kernel
    ``kernel(A, P, mask, **coefficients) -> Tensor``: a pure elementwise expression
    over the advantages, the process rewards (both in the computation dtype) and the
    loss mask, taking the coefficients named in ``coefficients`` as keywords. A
    ``unit_interval`` kernel returns ``(shaped, violated)`` instead, ``violated`` a 0-d
    bool tensor that is true when an active reward lies outside ``[0, 1]``.

    For a ``combined`` mode it is a combiner
    ``combiner(batch, loss_mask, *, judge_scorer, opd_scorer, table) -> ...`` that
    returns the ``[B, T]`` token signal (``yields="signal"``) or ``(advantages,
    loss_mask)`` (``yields="advantage"``), unshifted.
    """

    name: str
    family: Family
    implementation: str | Callable[..., Any] = field(repr=False)
    coefficients: tuple[str, ...] = ()
    """Names (keys of :data:`COEFFICIENT_DEFAULTS`) the kernel takes."""
    direct_advantages: bool = False
    """Needs ``actor.token_rewards_as_adv: true`` (it shapes direct process advantages)."""
    unit_interval: bool = False
    """Needs process rewards in ``[0, 1]`` (refuses ``mask_no_eos_with_zero`` and the
    signed combined signals); its kernel reports violations."""
    result_dtype: Literal["promoted", "advantages"] = "promoted"
    """The result's dtype, as AReaL's expression gives it: ``promoted`` when reward
    values enter the result (``promote(A, float32)``), ``advantages`` when the rewards
    only select (gvpo): fp16/bf16 advantages come back in their own dtype."""
    yields: Literal["signal", "advantage"] = "signal"
    """Combined modes: a token signal to shape, or the advantage itself (no outcome
    term, no shaping)."""
    own_turn_selection: bool = False
    """Combined modes: applies OpenClaw-RL's own turn selection, so it refuses
    ``trainer.exclude_neutral_turns``."""
    summary: str = ""

    def resolve(self) -> Callable[..., Any]:
        """The implementation, imported on first use."""
        if callable(self.implementation):
            return self.implementation
        fn = _RESOLVED.get(self.implementation)
        if fn is None:
            module, _, attribute = self.implementation.partition(":")
            fn = _RESOLVED[self.implementation] = getattr(importlib.import_module(module), attribute)
        return fn


_REGISTRY: dict[str, Mode] = {}
_RESOLVED: dict[str, Callable[..., Any]] = {}
_BUILT_IN: set[str] = set()


def register(mode: Mode) -> Mode:
    """Add ``mode`` to the registry; every list of names and every dispatch then knows it.

    Refuses a name already registered (in either family), an unknown family or
    coefficient, and options that do not apply to the mode's family.
    """
    if not isinstance(mode, Mode):
        raise TypeError(f"register() takes a Mode, got {type(mode).__name__}")
    if not mode.name or not mode.name.isidentifier():
        raise ConfigError(f"mode name must be a non-empty identifier, got {mode.name!r}")
    if mode.name in _REGISTRY:
        raise ConfigError(f"mode {mode.name!r} is already registered ({_REGISTRY[mode.name].family})")
    if mode.family not in ("advantage", "combined"):
        raise ConfigError(f"mode {mode.name!r}: family must be 'advantage' or 'combined', got {mode.family!r}")
    unknown = [c for c in mode.coefficients if c not in COEFFICIENT_DEFAULTS]
    if unknown:
        raise ConfigError(f"mode {mode.name!r}: unknown coefficients {unknown}; known: {list(COEFFICIENT_DEFAULTS)}")
    if mode.family == "advantage" and (mode.yields != "signal" or mode.own_turn_selection):
        raise ConfigError(f"mode {mode.name!r}: yields / own_turn_selection apply to combined modes only")
    if mode.family == "combined" and (
        mode.coefficients or mode.direct_advantages or mode.unit_interval or mode.result_dtype != "promoted"
    ):
        raise ConfigError(f"mode {mode.name!r}: coefficients and shaping options apply to advantage modes only")
    if not (callable(mode.implementation) or ":" in mode.implementation):
        raise ConfigError(f"mode {mode.name!r}: implementation must be a callable or 'module:attribute'")
    _REGISTRY[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    """Remove a mode registered with :func:`register` (built-in modes stay)."""
    if name in _BUILT_IN:
        raise ConfigError(f"built-in mode {name!r} cannot be unregistered")
    _REGISTRY.pop(name, None)


def mode_info(name: str) -> Mode | None:
    """The registry entry of ``name``, or None for an unknown mode."""
    return _REGISTRY.get(name)


def registered_modes(family: Family | None = None) -> tuple[Mode, ...]:
    """Every entry (of ``family``), in registration order."""
    return tuple(m for m in _REGISTRY.values() if family is None or m.family == family)


def _lookup(name: Any, family: Family, what: str) -> Mode:
    mode = _REGISTRY.get(name) if isinstance(name, str) else None
    if mode is None or mode.family != family:
        names = [m.name for m in registered_modes(family)]
        raise ConfigError(f"unknown {what} {name!r}; expected one of {names}")
    return mode


def shaping_mode(name: Any) -> Mode:
    """The ``advantage`` mode called ``name``; ``ValueError`` naming the valid ones otherwise."""
    return _lookup(name, "advantage", "shaping mode")


def combined_mode(name: Any) -> Mode:
    """The ``combined`` mode called ``name``; ``ValueError`` naming the valid ones otherwise."""
    return _lookup(name, "combined", "combined mode")


def check_coefficient(name: str, value: Any) -> float:
    """A coefficient as a float: a real number, finite and ``>= 0`` (else ``ValueError``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


class _Names(Sequence[str]):
    """A live, read-only view of one family's mode names (registration order).

    Compares equal to a tuple or list of the same names; a mode registered later
    appears in it at once, so lists derived from it (CLI choices) include it.
    """

    __slots__ = ("_family",)

    def __init__(self, family: Family) -> None:
        self._family: Family = family

    def _names(self) -> tuple[str, ...]:
        return tuple(m.name for m in registered_modes(self._family))

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        mode = _REGISTRY.get(name) if isinstance(name, str) else None
        return mode is not None and mode.family == self._family

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (_Names, tuple, list)):
            return self._names() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._names())


SHAPING_MODES: Final[Sequence[str]] = _Names("advantage")
"""Valid ``advantage_shaping.mode`` values (AReaL's Process Rewards, "Advantage Shaping")."""
COMBINED_MODES: Final[Sequence[str]] = _Names("combined")
"""Valid ``trainer.combined_mode`` values (PRM + OPD combinations)."""


def mode_table() -> str:
    """The Markdown table of every registered mode (docs/trainer.md embeds it; a test
    keeps the two equal)."""
    rows = ["| mode | family | coefficients | needs | what it does |", "|---|---|---|---|---|"]
    for m in registered_modes():
        needs = [
            *(["`token_rewards_as_adv`"] if m.direct_advantages else []),
            *(["rewards in [0, 1]"] if m.unit_interval else []),
            *(["`worker.keep_scorer_channels`"] if m.family == "combined" else []),
            *(["no `exclude_neutral_turns`"] if m.own_turn_selection else []),
        ]
        family = m.family if m.family == "advantage" else f"combined ({m.yields})"
        coefficients = ", ".join(f"`{c}`" for c in m.coefficients) or "—"
        rows.append(f"| `{m.name}` | {family} | {coefficients} | {', '.join(needs) or '—'} | {m.summary} |")
    return "\n".join(rows)


for _mode in (
    Mode("additive", "advantage", "shaper.shaping:additive_kernel", summary="A + P"),
    Mode(
        "gvpo",
        "advantage",
        "shaper.shaping:gvpo_kernel",
        coefficients=tuple(COEFFICIENT_DEFAULTS),
        direct_advantages=True,
        result_dtype="advantages",
        summary="failed tokens (P < 0) reshape A",
    ),
    Mode(
        "process_weighted",
        "advantage",
        "shaper.shaping:process_weighted_kernel",
        direct_advantages=True,
        unit_interval=True,
        summary="P in [0, 1] weights A",
    ),
    Mode(
        "prm_gated_opd",
        "combined",
        "shaper.combiners:prm_gated_opd_signal",
        summary="judge score gates the OPD token signal",
    ),
    Mode(
        "prm_weighted_opd",
        "combined",
        "shaper.combiners:prm_weighted_opd_signal",
        summary="judge score weights the OPD token signal",
    ),
    Mode(
        "openclaw_combine",
        "combined",
        "shaper.combiners:openclaw_combine_advantage",
        yields="advantage",
        own_turn_selection=True,
        summary="OpenClaw-RL's combine: per-turn OPD/RL dispatch, w_opd*(T - old) + w_rl*score",
    ),
):
    register(_mode)
    _BUILT_IN.add(_mode.name)
del _mode
