"""The mode registry (infra.modes) is the one dispatcher for shaping and combined modes.

A mode registered from this module — one registry entry plus its kernel or combiner,
nothing else — is accepted by config validation, offered by the CLI and run by the
trainer; an unknown mode is refused where the config is built, never replaced by a
default.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

from infra.config import ConfigError, config_from_mapping
from infra.config import PRMAdvantageShapingConfig as Shaping
from infra.config import TrainerConfig as Trainer
from infra.modes import (
    COEFFICIENT_DEFAULTS,
    COMBINED_MODES,
    SHAPING_MODES,
    Mode,
    mode_table,
    register,
    unregister,
)
from prm_pipeline.cli import build_parser
from shaper.combiners import combined_token_signal
from shaper.shaping import shape_advantages
from shaper.trainer import _configure, shape_batch
from tests.unit.test_channels import JUDGE, combined_batch
from tests.unit.test_exclusion import cases_batch

REPO = Path(__file__).resolve().parents[2]


def damped_kernel(a: Tensor, p: Tensor, mask: Tensor, *, zero_penalty: float) -> Tensor:
    """A test mode: ``A + zero_penalty * P`` on active positions."""
    active = mask if mask.dtype == torch.bool else mask != 0
    return torch.where(active, a + zero_penalty * p, a)


def judge_only_signal(batch, loss_mask, *, judge_scorer, opd_scorer, table=None) -> Tensor:
    """A test combined mode: the judge's channel alone, on the loss mask."""
    return torch.where(loss_mask, batch.channels[judge_scorer], 0.0)


@pytest.fixture
def damped() -> Iterator[Mode]:
    yield register(Mode("damped", "advantage", damped_kernel, coefficients=("zero_penalty",), summary="A + c*P"))
    unregister("damped")


@pytest.fixture
def judge_only() -> Iterator[Mode]:
    yield register(Mode("judge_only", "combined", judge_only_signal, summary="the judge channel alone"))
    unregister("judge_only")


def _config(mode: str, **trainer: object):
    return config_from_mapping(
        {
            "rollout": {"agent": {"prm": {"advantage_shaping": {"mode": mode, "zero_penalty": 0.5}}}},
            "actor": {"token_rewards_as_adv": True},
            "trainer": trainer,
        },
        environ={},
    )


def test_a_registered_shaping_mode_is_accepted_everywhere(damped: Mode, tmp_path: Path) -> None:
    assert "damped" in SHAPING_MODES and SHAPING_MODES[-1] == "damped"
    cfg = _config("damped")  # config validation
    assert cfg.prm.advantage_shaping.coefficients() == (0.5,)
    args = build_parser().parse_args(["trainer", "--mode", "damped"])  # CLI choices
    assert _configure(args).prm.advantage_shaping.mode == "damped"
    batch = cases_batch()  # the trainer runs its kernel with the configured coefficient
    shaped = shape_batch(batch, cfg.prm.advantage_shaping)
    expected = shape_batch(batch, Shaping(mode="additive"))
    torch.testing.assert_close(shaped.advantages, expected.outcome_advantages + 0.5 * expected.token_rewards)
    a, p, m = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0]), torch.tensor([True, False])
    assert shape_advantages(a, p, m, mode="damped", zero_penalty=0.25).tolist() == [1.5, 2.0]


def test_a_registered_combined_mode_is_accepted_everywhere(judge_only: Mode) -> None:
    cfg = _config("additive", combined_mode="judge_only")
    assert cfg.trainer.combined_mode == "judge_only"
    args = build_parser().parse_args(["trainer", "--combined-mode", "judge_only"])
    assert _configure(args).trainer.combined_mode == "judge_only"
    batch = combined_batch()
    shaped = shape_batch(batch, Shaping(mode="additive"), Trainer(combined_mode="judge_only"))
    signal = combined_token_signal(batch, "judge_only")
    torch.testing.assert_close(signal, torch.where(batch.loss_mask, batch.channels[JUDGE], 0.0))
    assert shaped.token_rewards[0, :-1].tolist() == signal[0, 1:].tolist()  # shifted by one


def test_unregistered_modes_are_refused_where_the_config_is_built() -> None:
    assert "damped" not in SHAPING_MODES and "judge_only" not in COMBINED_MODES
    with pytest.raises(ConfigError, match="advantage_shaping.mode must be one of"):
        Shaping(mode="damped")
    with pytest.raises(ConfigError, match="advantage_shaping.mode must be one of"):
        _config("damped")
    with pytest.raises(ConfigError, match="trainer.combined_mode must be one of"):
        Trainer(combined_mode="judge_only")  # once silently run as prm_gated_opd by shape_batch
    with pytest.raises(ValueError, match="unknown combined mode 'judge_only'"):
        combined_token_signal(combined_batch(), "judge_only")
    with pytest.raises(ValueError, match="unknown shaping mode 'damped'"):
        shape_advantages(torch.zeros(2), torch.zeros(2), torch.ones(2), mode="damped")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["trainer", "--mode", "damped"])


def test_checked_structs_cannot_be_changed_afterwards() -> None:
    shaping, trainer = Shaping(mode="gvpo"), Trainer()
    with pytest.raises(AttributeError):
        shaping.mode = "nope"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        trainer.combined_mode = "nope"  # type: ignore[misc]
    with pytest.raises(ConfigError, match="zero_eps must be a finite number >= 0"):
        Shaping(zero_eps=float("nan"))


def test_registry_rules() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(Mode("gvpo", "advantage", damped_kernel))
    with pytest.raises(ValueError, match="unknown coefficients"):
        register(Mode("x", "advantage", damped_kernel, coefficients=("temperature",)))
    with pytest.raises(ValueError, match="advantage modes only"):
        register(Mode("x", "combined", judge_only_signal, unit_interval=True))
    with pytest.raises(ValueError, match="cannot be unregistered"):
        unregister("additive")
    assert "x" not in SHAPING_MODES and "x" not in COMBINED_MODES


def test_coefficient_defaults_live_in_the_registry() -> None:
    shaping = Shaping()
    assert {name: getattr(shaping, name) for name in COEFFICIENT_DEFAULTS} == {
        "negative_scale": 0.2,
        "zero_penalty": 0.4,
        "zero_eps": 1e-6,
    }
    assert Shaping(mode="gvpo").coefficients() == (0.2, 0.4, 1e-6) and Shaping().coefficients() == ()


def test_docs_show_the_registry_table() -> None:
    assert mode_table() in (REPO / "docs" / "trainer.md").read_text()
