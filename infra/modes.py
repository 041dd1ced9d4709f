"""The one registry of shaping modes: every list of mode names is derived from it.

Two families share it. ``advantage`` modes are the values of AReaL's
``rollout.agent.prm.advantage_shaping.mode``: they decide how a per-token process
signal is folded into outcome advantages (:func:`shaper.shape_advantages`).
``combined`` modes are ``trainer.combined_mode`` values: they decide *which* per-token
signal the trainer builds from two scorers' channels (:mod:`shaper.combined`); an
advantage mode still folds it in. Config validation, the CLI's choices and the shaper
all read this table, so adding a mode is one :class:`Mode` line here plus its
implementation. ``infra`` must not import the shaper (torch), hence it lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["MODES", "Mode", "SHAPING_MODES", "COMBINED_MODES", "mode_info"]


@dataclass(frozen=True, slots=True)
class Mode:
    """One shaping mode and the configuration rules that depend on it."""

    name: str
    family: Literal["advantage", "combined"]
    direct_advantages: bool = False
    """Needs ``actor.token_rewards_as_adv: true`` (it shapes direct process advantages)."""
    unit_interval: bool = False
    """Needs process rewards in ``[0, 1]`` (refuses ``mask_no_eos_with_zero`` and signed
    combined signals)."""
    summary: str = ""


MODES: Final[tuple[Mode, ...]] = (
    Mode("additive", "advantage", summary="A + P"),
    Mode("gvpo", "advantage", direct_advantages=True, summary="failed tokens (P < 0) reshape A"),
    Mode("process_weighted", "advantage", direct_advantages=True, unit_interval=True,
         summary="P in [0, 1] weights A"),
    Mode("prm_gated_opd", "combined", summary="judge score gates the OPD token signal"),
    Mode("prm_weighted_opd", "combined", summary="judge score weights the OPD token signal"),
    Mode("openclaw_combine", "combined",
         summary="OpenClaw-RL's combine: per-turn OPD/RL dispatch, w_opd*(T - old) + w_rl*score"),
)

SHAPING_MODES: Final[tuple[str, ...]] = tuple(m.name for m in MODES if m.family == "advantage")
"""Valid ``advantage_shaping.mode`` values (AReaL's Process Rewards, "Advantage Shaping")."""
COMBINED_MODES: Final[tuple[str, ...]] = tuple(m.name for m in MODES if m.family == "combined")
"""Valid ``trainer.combined_mode`` values (PRM + OPD combinations)."""

_BY_NAME: Final[dict[str, Mode]] = {m.name: m for m in MODES}


def mode_info(name: str) -> Mode | None:
    """The registry entry of ``name``, or None for an unknown mode."""
    return _BY_NAME.get(name)
