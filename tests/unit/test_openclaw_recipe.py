"""OpenClaw-RL's training recipes (shaper.openclaw_recipe, shaper.combined.openclaw_combine,
shaper.exclusion.streaming_turn_keep / unhinted_turns) with concrete upstream values.

Rows use the three-turn layout of tests/unit/test_exclusion.py (t0 at 3-4, t1 at 6-7, t2 at 9-11).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from infra.config import ConfigError
from infra.config import PRMAdvantageShapingConfig as Shaping
from infra.config import TrainerConfig as Trainer
from infra.schema import PRMMetricObservation, PRMTurnResult, TokenRewards
from shaper import build_training_batch
from shaper.combined import openclaw_combine
from shaper.exclusion import apply_exclusion, streaming_turn_keep, unhinted_turns
from shaper.openclaw_recipe import openclaw_turn_advantages
from shaper.shaping import shift_token_rewards
from shaper.trainer import shape_batch
from tests.unit.test_exclusion import CASES, T0_POS, T1_POS, T2_POS, group, linear, mask_at

OPD = "opd_teacher"

# Same sessions as the exclusion tests: (judge (score, has_next_state) per turn) -> turns OpenClaw-RL trains.
UPSTREAM_KEPT = {
    "mixed": [T0_POS],  # t0 effective; t1 neutral (a sample exists already); t2 last
    "all_neutral": [T0_POS],  # at-least-one: the first turn with a next state, rescued
    "first_without_next": [T1_POS],
    "no_candidate": [],
    "negative_is_effective": [T0_POS],
    "late_effective": [T0_POS],  # upstream streams: leading neutral t0 is kept; t2 is the last turn: dropped
    "all_effective": [T0_POS, T1_POS],  # the last turn is dropped even when it was judged effective
}


def _cases_batch():
    return build_training_batch([group(f"g-{name}", [linear(name, turns)]) for name, (turns, _) in CASES.items()])


# --------------------------------------------------------------------------- openclaw_turns
def test_streaming_keep_on_raw_tensors():
    scores = torch.tensor([[0.0, 1.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0, 0.0]])
    has_next = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0]], dtype=torch.bool)
    judged = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    keep = streaming_turn_keep(scores, has_next, judged, torch.tensor([0, 1, 2]))
    assert keep.tolist() == [
        [True, True, False, True, False],  # leading neutral rescued, later neutral excluded, last dropped
        [True, False, False, False, False],  # all neutral: only the first with a next state
        [False, True, True, True, False],  # first turn has no next state: t1 is the rescued one
    ]
    # Rows of one session (branches) share the first candidate turn number.
    two_rows = streaming_turn_keep(scores[:2], has_next[:2], judged[:2], torch.tensor([0, 0]))
    assert two_rows[:, 0].tolist() == [True, True]


def test_openclaw_turn_samples_through_verdicts():
    batch = _cases_batch()
    advantages, mask = openclaw_turn_advantages(batch)
    for row, name in enumerate(CASES):
        assert mask[row].tolist() == mask_at(*UPSTREAM_KEPT[name]), name
        scores = [s for s, _ in CASES[name][0]]
        expected = [0.0] * 12
        for k, block in enumerate((T0_POS, T1_POS, T2_POS)):
            if any(mask[row, p] for p in block):
                for p in block:
                    expected[p] = scores[k]  # the sample's reward = the judge score, no normalisation
        assert advantages[row].tolist() == expected, name


def test_upstream_recipe_differs_from_our_exclusion_where_documented():
    batch = _cases_batch()
    ours = apply_exclusion(batch)
    _, upstream = openclaw_turn_advantages(batch)
    late = list(CASES).index("late_effective")
    assert ours[late].tolist() == mask_at(T2_POS) and upstream[late].tolist() == mask_at(T0_POS)


def test_shape_batch_openclaw_turns_has_no_outcome_term():
    batch = _cases_batch()
    shaped = shape_batch(batch, Shaping(mode="additive"), Trainer(recipe="openclaw_turns"))
    advantages, mask = openclaw_turn_advantages(batch)
    assert shaped.loss_mask.tolist() == shift_token_rewards(mask).tolist()
    assert shaped.advantages.tolist() == shift_token_rewards(advantages).tolist()
    assert not shaped.outcome_advantages.any()
    mixed = list(CASES).index("mixed")  # t0 (score 1) at positions 3-4 -> logits 2-3 after the shift
    assert shaped.advantages[mixed].tolist()[:5] == [0.0, 0.0, 1.0, 1.0, 0.0]


def test_recipe_checks():
    """Checked once, when the trainer config is built (file or code), never per batch."""
    with pytest.raises(ConfigError, match="trainer.recipe must be one of"):
        Trainer(recipe="ppo")
    with pytest.raises(ConfigError, match="cannot be combined"):
        Trainer(recipe="openclaw_turns", combined_mode="prm_gated_opd")
    with pytest.raises(ConfigError, match="exclude_neutral_turns off"):
        Trainer(recipe="openclaw_turns", exclude_neutral_turns=True)
    with pytest.raises(ConfigError, match="combined_mode 'openclaw_combine' applies"):
        Trainer(combined_mode="openclaw_combine", exclude_neutral_turns=True)
    with pytest.raises(
        ConfigError, match="trainer.online_samples .* needs trainer.recipe 'openclaw_turns', got 'grpo'"
    ):
        Trainer(online_samples=True)
    assert Trainer(recipe="openclaw_turns", online_samples=True).online_samples


# --------------------------------------------------------------------------- openclaw_combine
def test_openclaw_combine_dispatch_table():
    # One row, four turns of two tokens: (hint, score) = (yes, +1), (yes, 0), (no, -1), (no, 0).
    opd = torch.tensor([[0.5, -0.25, 0.2, 0.4, 9.0, 9.0, 9.0, 9.0]])
    scores = torch.tensor([[1.0, 0.0, -1.0, 0.0]])
    hint = torch.tensor([[True, True, False, False]])
    turn_index = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]])
    loss_mask = torch.ones(1, 8, dtype=torch.bool)
    adv, mask = openclaw_combine(opd, scores, hint, turn_index, loss_mask, w_opd=2.0, w_rl=0.5)
    assert mask.tolist() == [[True] * 6 + [False] * 2]  # no hint, no score: dropped
    torch.testing.assert_close(
        adv,
        torch.tensor(
            [
                [
                    2.0 * 0.5 + 0.5,
                    2.0 * -0.25 + 0.5,  # OPD + RL
                    2.0 * 0.2,
                    2.0 * 0.4,  # OPD only (reward 0.0)
                    -0.5,
                    -0.5,  # RL only: teacher = rollout, no OPD term
                    0.0,
                    0.0,
                ]
            ]
        ),
    )
    masked = openclaw_combine(opd, scores, hint, turn_index, torch.zeros(1, 8))
    assert not masked[1].any() and not masked[0].any()


def test_openclaw_combine_rejects_bad_inputs():
    opd, scores, ti, lm = torch.zeros(1, 2), torch.zeros(1, 1), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(ValueError, match="hint_accepted"):
        openclaw_combine(opd, scores, torch.ones(1, 2, dtype=torch.bool), ti, lm)
    with pytest.raises(ValueError, match="w_rl"):
        openclaw_combine(opd, scores, torch.ones(1, 1, dtype=torch.bool), ti, lm, w_rl=float("nan"))


def _with_opd(session, hints: list[bool], opd_values: list[float]):
    """Add an OPD scorer's turn results (hint_accepted) and both scorers' channels to a linear session."""
    path = session.branches[0].path
    results = [
        PRMTurnResult(
            interaction_id=iid,
            scorer_name=OPD,
            reward=v,
            observations=(
                PRMMetricObservation(
                    metric_id="hint_accepted",
                    scope="turn",
                    target_id=iid,
                    value=h,
                    value_type="boolean",
                    aggregations=("count", "rate"),
                ),
            ),
        )
        for iid, h, v in zip(path, hints, opd_values)
    ]
    lengths = [2, 2, 3]
    branch = session.branches[0]
    channels = {
        "openclaw_judge": {
            iid: TokenRewards(length=n, uniform=branch.token_rewards[iid].uniform) for iid, n in zip(path, lengths)
        },
        OPD: {iid: TokenRewards(length=n, uniform=v) for iid, n, v in zip(path, lengths, opd_values)},
    }
    totals = {**branch.scorer_totals, OPD: float(sum(opd_values))}
    branch = msgspec.structs.replace(branch, channels=channels, scorer_totals=totals)
    return msgspec.structs.replace(session, branches=[branch], turn_results=[*session.turn_results, *results])


def test_shape_batch_openclaw_combine_and_drop_unhinted():
    session = _with_opd(linear("s", [(1.0, True), (0.0, True), (0.0, False)]), [False, True, False], [0.0, 0.3, 0.0])
    batch = build_training_batch([group("g", [session])])
    assert unhinted_turns(batch).tolist() == [[True, False, True]]
    shaped = shape_batch(batch, Shaping(mode="process_weighted"), Trainer(combined_mode="openclaw_combine"))
    # t0: RL only (score 1); t1: OPD only (0.3); t2: neither -> dropped. Shifted left by one.
    expected = np.zeros(12, np.float32)
    expected[[2, 3]] = 1.0
    expected[[5, 6]] = 0.3
    torch.testing.assert_close(shaped.advantages[0], torch.from_numpy(expected))
    assert shaped.loss_mask[0].tolist() == shift_token_rewards(torch.tensor([mask_at(T0_POS, T1_POS)]))[0].tolist()
    assert not shaped.outcome_advantages.any()
    # OpenClaw-RL's OPD trains no turn without an accepted hint: only t1 stays in the loss.
    dropped = shape_batch(batch, Shaping(mode="additive"), Trainer(drop_unhinted_turns=True))
    assert dropped.loss_mask[0].tolist() == shift_token_rewards(torch.tensor([mask_at(T1_POS)]))[0].tolist()
    with pytest.raises(ValueError, match="no per-turn results of scorer 'nope'"):
        shape_batch(batch, Shaping(mode="additive"), Trainer(drop_unhinted_turns=True, opd_scorer="nope"))


def test_config_names_the_openclaw_modes():
    from infra.config import COMBINED_MODES, TrainerConfig

    assert "openclaw_combine" in COMBINED_MODES
    cfg = msgspec.convert({"recipe": "openclaw_turns", "drop_unhinted_turns": True}, TrainerConfig)
    assert (cfg.recipe, cfg.drop_unhinted_turns, cfg.combined_mode) == ("openclaw_turns", True, None)
    assert msgspec.convert({"combined_mode": "openclaw_combine"}, TrainerConfig).combined_mode == "openclaw_combine"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"recipe": "ppo"}, TrainerConfig)
