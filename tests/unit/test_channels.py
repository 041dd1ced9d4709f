"""Per-scorer token-reward channels: runner -> wire -> batch -> combined shaping.

Covers ``worker.keep_scorer_channels`` (the runner keeps each scorer's weighted token
rewards, the worker puts them on ``BranchResult.channels``), the wire compatibility of
the optional field, the batch layout (``TrainingBatch.channels``), and the trainer's
``combined_mode`` through :func:`shaper.trainer.shape_batch` on hand-computed tensors.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import yaml

from infra.config import ConfigError, PipelineConfig, PRMConfig, WorkerConfig, config_from_mapping, load_config
from infra.config import PRMAdvantageShapingConfig as Shaping
from infra.config import TrainerConfig as Trainer
from infra.schema import (
    BranchResult,
    GroupVerdict,
    TokenRewards,
    decode_verdict,
    encode,
)
from prm_pipeline.demo.synthetic import make_session
from scoring_workers.prm import BaseScorer, PRMRunner
from shaper import build_training_batch
from shaper.batch import ConcatExportError
from shaper.combined import turn_scores_from_tokens
from shaper.trainer import shape_batch
from tests.unit.test_exclusion import JUDGE, group, scored_session, three_turns

OPD = "opd_teacher"
A = 0.5 / (0.5 + 1e-6)  # GRPO advantage of outcomes (1, 0) in a group of two: (r - 0.5) / (std 0.5 + eps)


# --------------------------------------------------------------------------- wire
class OldBranchResult(msgspec.Struct, frozen=True, kw_only=True):
    """BranchResult as it was before channels existed."""

    leaf_id: str
    path: list[str]
    token_rewards: dict[str, TokenRewards]
    scorer_totals: dict[str, float]


def _branch(**extra) -> BranchResult:
    return BranchResult(
        leaf_id="t1",
        path=["t0", "t1"],
        scorer_totals={"s": 1.0},
        token_rewards={
            "t0": TokenRewards(length=2, uniform=0.5),
            "t1": TokenRewards.from_array(np.array([1, 2], np.float32)),
        },
        **extra,
    )


def test_branch_without_channels_encodes_exactly_as_before() -> None:
    new = _branch()
    old = OldBranchResult(
        leaf_id=new.leaf_id, path=new.path, token_rewards=new.token_rewards, scorer_totals=new.scorer_totals
    )
    assert msgspec.msgpack.encode(new) == msgspec.msgpack.encode(old)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=BranchResult) == new


def test_channels_round_trip_and_old_readers_ignore_them() -> None:
    branch = _branch(
        channels={
            "s": {
                "t0": TokenRewards(length=2, uniform=0.5),
                "t1": TokenRewards.from_array(np.array([1, 2], np.float32)),
            }
        }
    )
    raw = msgspec.msgpack.encode(branch)
    assert msgspec.msgpack.decode(raw, type=BranchResult) == branch
    assert msgspec.msgpack.decode(raw, type=OldBranchResult).token_rewards == branch.token_rewards
    verdict = GroupVerdict(group_id="g", status="accepted")
    assert decode_verdict(*encode(verdict)) == verdict


# --------------------------------------------------------------------------- runner
class Dense(BaseScorer):
    name = "dense"

    async def evaluate(self, interaction, ctx):
        return torch.arange(interaction.model_response.output_len, dtype=torch.float32)


class Flat(BaseScorer):
    name = "flat"

    async def evaluate(self, interaction, ctx):
        return 0.5


class Minus(BaseScorer):
    name = "minus"

    async def evaluate(self, interaction, ctx):
        return -torch.ones(interaction.model_response.output_len)


def _runner() -> PRMRunner:
    # A tensor scorer first: the running sum starts as its tensor and is added to in
    # place afterwards, which must not leak into the kept channel.
    return PRMRunner(PRMConfig(scorers=[Dense(weight=2.0), Flat(weight=1.0), Minus(weight=0.5)]))


def _traj(turns: int = 2, out: int = 4):
    return make_session(trajectory_id="tr", session_id="s", group_id="g", group_size=1, turns=turns, output_tokens=out)


async def test_runner_keeps_weighted_channels_and_the_same_sum() -> None:
    runner, traj = _runner(), _traj()
    plain = await runner.run(traj)
    kept = await runner.run(traj, keep_channels=True)
    (branch,) = kept.branches
    assert plain.branches[0].channels == {}
    assert list(branch.channels) == ["dense", "flat", "minus"]
    for iid in branch.path:
        dense = branch.channels["dense"][iid]
        assert torch.equal(dense, torch.tensor([0.0, 2.0, 4.0, 6.0]))  # weighted, untouched by the sum
        assert branch.channels["flat"][iid] == TokenRewards(length=4, uniform=0.5)
        assert torch.equal(branch.channels["minus"][iid], torch.full((4,), -0.5))
        expected = torch.tensor([0.0, 2.0, 4.0, 6.0]) + 0.5 - 0.5
        assert torch.equal(branch.token_rewards[iid], expected)
        assert torch.equal(plain.branches[0].token_rewards[iid], expected)
    wire = kept.to_branch_results()[0]
    assert wire.channels["flat"][branch.path[0]] == TokenRewards(length=4, uniform=0.5)
    assert wire.channels["dense"][branch.path[0]].to_numpy().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert "channels" not in msgspec.msgpack.decode(msgspec.msgpack.encode(plain.to_branch_results()[0]))


async def test_worker_passes_the_option_and_the_trainer_reads_the_channels() -> None:
    from scoring_workers.worker import Worker

    traj = _traj(turns=3, out=3)
    runner = _runner()
    off = await Worker(PipelineConfig(), runner=runner)._score(traj)
    on = await Worker(PipelineConfig(worker=WorkerConfig(keep_scorer_channels=True)), runner=runner)._score(traj)
    assert all(not b.channels for b in off.branches)
    assert set(on.branches[0].channels) == {"dense", "flat", "minus"}
    assert on.branches[0].token_rewards == off.branches[0].token_rewards
    batch = build_training_batch([GroupVerdict(group_id="g", status="accepted", sessions=[on])])
    assert set(batch.channels) == {"dense", "flat", "minus"}
    mask = batch.loss_mask[0]
    assert batch.channels["dense"][0][mask].tolist() == [0.0, 2.0, 4.0] * 3
    assert (batch.channels["dense"][0][~mask] == 0).all()
    total = sum(batch.channels.values())
    assert torch.equal(total, batch.token_rewards)  # the channels add up to the summed rewards
    assert set(batch.turn_results[0]) == {"dense", "flat", "minus"}  # per-turn results travel too
    assert build_training_batch([GroupVerdict(group_id="g", status="accepted", sessions=[off])]).channels == {}


# --------------------------------------------------------------------------- batch layout
def tr(values) -> TokenRewards:
    return TokenRewards.from_array(np.asarray(values, np.float32))


# Judge: +1 / -1 / 0 (no next state) and +1 / +1 / 0 (no next state); OPD: dense signals.
JUDGE_TURNS = {
    "a": [(1.0, True), (-1.0, True), (0.0, False)],
    "b": [(1.0, True), (1.0, True), (0.0, False)],
}
OPD_SIGNAL = {
    "a": [[0.5, -0.2], [0.3, 0.1], [0.7, 0.4, -0.6]],
    "b": [[0.2, 0.4], [-0.1, 0.6], [0.9, 0.9, 0.9]],
}


def combined_session(sid: str, outcome: float, *, with_channels: bool = True, judge_weight: float = 1.0):
    turns = JUDGE_TURNS[sid]
    ids = [f"{sid}-t0", f"{sid}-t1", f"{sid}-t2"]
    lengths = [2, 2, 3]
    channels = {
        JUDGE: {iid: TokenRewards(length=n, uniform=judge_weight * s) for iid, n, (s, _) in zip(ids, lengths, turns)},
        OPD: {iid: tr(v) for iid, v in zip(ids, OPD_SIGNAL[sid])},
    }
    return scored_session(
        sid,
        three_turns(sid),
        {ids[-1]: turns},
        outcome=outcome,
        channels={ids[-1]: channels} if with_channels else None,
    )


def combined_batch(**kwargs):
    return build_training_batch(
        [group("g", [combined_session("a", 1.0, **kwargs), combined_session("b", 0.0, **kwargs)])]
    )


def test_batch_lays_channels_out_like_token_rewards() -> None:
    batch = combined_batch()
    assert set(batch.channels) == {JUDGE, OPD}
    assert batch.channels[OPD][0].tolist() == pytest.approx([0, 0, 0, 0.5, -0.2, 0, 0.3, 0.1, 0, 0.7, 0.4, -0.6])
    assert batch.channels[JUDGE][0].tolist() == [0, 0, 0, 1, 1, 0, -1, -1, 0, 0, 0, 0]
    assert batch.to("meta").channels[OPD].device.type == "meta"


def test_channel_only_batched_when_every_row_has_it() -> None:
    mixed = build_training_batch(
        [group("g", [combined_session("a", 1.0)]), group("h", [combined_session("b", 0.0, with_channels=False)])]
    )
    assert mixed.channels == {}  # a zero-filled hole would read as a real zero signal


def test_channel_that_misses_a_turn_is_refused() -> None:
    s = combined_session("a", 1.0)
    branch = s.branches[0]
    holed = msgspec.structs.replace(
        branch, channels={OPD: {k: v for k, v in branch.channels[OPD].items() if not k.endswith("t1")}}
    )
    with pytest.raises(ConcatExportError, match="channel of scorer 'opd_teacher' has no rewards") as err:
        build_training_batch([group("g", [msgspec.structs.replace(s, branches=[holed])])])
    assert err.value.reason == "channel_mismatch"


def test_turn_scores_from_tokens_is_the_per_turn_mean() -> None:
    values = torch.tensor([[9.0, 1.0, 3.0, 9.0, -2.0], [4.0, 4.0, 9.0, 9.0, 9.0]])
    turn_index = torch.tensor([[-1, 0, 0, -1, 1], [0, 0, -1, -1, -1]])
    assert turn_scores_from_tokens(values, turn_index, 3).tolist() == [[2.0, -2.0, 0.0], [4.0, 0.0, 0.0]]


# --------------------------------------------------------------------------- combined shaping
# Shifted positions of the three turns: t0 -> 2, 3; t1 -> 5, 6; t2 -> 8, 9, 10.
SHIFTED_MASK = [False, False, True, True, False, True, True, False, True, True, True, False]


def _expected(rows_p: list[list[float]], outcomes_adv: list[float]) -> torch.Tensor:
    mask = torch.tensor([SHIFTED_MASK, SHIFTED_MASK])
    p = torch.tensor(rows_p)
    return torch.tensor(outcomes_adv).unsqueeze(1) * mask + p


def test_prm_gated_opd_through_shape_batch() -> None:
    shaped = shape_batch(combined_batch(), Shaping(mode="additive"), Trainer(combined_mode="prm_gated_opd"))
    # a: t0 good -> OPD; t1 first bad -> -1; t2 cut -> 0.
    # b: t0, t1 good -> OPD; t2 has no next state: unjudged, 0 (not the -1 penalty).
    p = [[0, 0, 0.5, -0.2, 0, -1, -1, 0, 0, 0, 0, 0], [0, 0, 0.2, 0.4, 0, -0.1, 0.6, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(shaped.token_rewards, torch.tensor(p))
    torch.testing.assert_close(shaped.advantages, _expected(p, [A, -A]))
    assert shaped.loss_mask.tolist() == [SHIFTED_MASK, SHIFTED_MASK]


def test_prm_weighted_opd_through_shape_batch_with_weighted_judge() -> None:
    # judge weight 2: the channel carries 2 * score, and the product scales with it
    shaped = shape_batch(
        combined_batch(judge_weight=2.0), Shaping(mode="additive"), Trainer(combined_mode="prm_weighted_opd")
    )
    p = [[0, 0, 1.0, -0.4, 0, -0.6, -0.2, 0, 0, 0, 0, 0], [0, 0, 0.4, 0.8, 0, -0.2, 1.2, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(shaped.token_rewards, torch.tensor(p))
    torch.testing.assert_close(shaped.advantages, _expected(p, [A, -A]))


def test_combined_mode_with_exclusion_and_gvpo() -> None:
    # exclusion drops t2 of both rows (no next state); gvpo: negative P punishes where A < 0,
    # clamps A > 0 to 0 (row a's penalised t1), keeps A where P >= 0.
    shaped = shape_batch(
        combined_batch(),
        Shaping(mode="gvpo", negative_scale=0.5),
        Trainer(combined_mode="prm_gated_opd", exclude_neutral_turns=True),
    )
    kept = [False, False, True, True, False, True, True, False, False, False, False, False]
    assert shaped.loss_mask.tolist() == [kept, kept]
    a_row = [0, 0, A, 0.0, 0, 0.0, 0.0, 0, 0, 0, 0, 0]  # -0.2 at pos 3 and -1 at 5, 6: A>0 -> 0
    b_row = [0, 0, -A, -A, 0, -A * 1.5, -A, 0, 0, 0, 0, 0]  # -0.1 at pos 5: A<0 -> A * (1 + 0.5)
    torch.testing.assert_close(shaped.advantages, torch.tensor([a_row, b_row]))


def test_combined_mode_needs_both_channels() -> None:
    batch = combined_batch(with_channels=False)
    with pytest.raises(ValueError, match="worker.keep_scorer_channels: true"):
        shape_batch(batch, Shaping(mode="additive"), Trainer(combined_mode="prm_weighted_opd"))
    with pytest.raises(ValueError, match=r"missing \['teacher'\]"):
        shape_batch(
            combined_batch(), Shaping(mode="additive"), Trainer(combined_mode="prm_gated_opd", opd_scorer="teacher")
        )


@pytest.mark.parametrize("judge", ["judge", "no_such_judge"])
def test_gated_mode_without_channels_names_the_setting_that_fixes_it(judge: str) -> None:
    """prm_gated_opd also reads the judge's turn results; without channels the error must
    name worker.keep_scorer_channels, not trainer.exclude_neutral_turns (never turned on)."""
    with pytest.raises(ValueError) as info:
        shape_batch(
            combined_batch(with_channels=False),
            Shaping(mode="additive"),
            Trainer(combined_mode="prm_gated_opd", judge_scorer=judge),
        )
    assert "worker.keep_scorer_channels: true" in str(info.value)
    assert "exclude_neutral_turns" not in str(info.value)


def test_gated_mode_without_judge_results_names_the_mode() -> None:
    from shaper.exclusion import judge_turn_table

    with pytest.raises(ValueError, match="which trainer.combined_mode prm_gated_opd needs") as info:
        judge_turn_table(combined_batch(), "no_such_judge", needed_by="trainer.combined_mode prm_gated_opd")
    assert "exclude_neutral_turns" not in str(info.value)


def test_combined_modes_are_not_shaping_modes() -> None:
    def build(shaping: str, combined: str | None) -> PipelineConfig:
        return config_from_mapping(
            {
                "rollout": {"agent": {"prm": {"advantage_shaping": {"mode": shaping}}}},
                "actor": {"token_rewards_as_adv": True},
                "trainer": {"combined_mode": combined},
            },
            environ={},
        )

    assert build("process_weighted", None).trainer.combined_mode is None
    assert build("additive", "prm_gated_opd").trainer.combined_mode == "prm_gated_opd"
    assert build("process_weighted", "openclaw_combine").trainer.combined_mode == "openclaw_combine"  # not shaped
    with pytest.raises(ConfigError, match="trainer.combined_mode must be one of"):
        Trainer(combined_mode="gvpo")
    with pytest.raises(ConfigError, match="process_weighted"):
        build("process_weighted", "prm_weighted_opd")
    with pytest.raises(ConfigError, match="advantage_shaping.mode must be one of"):
        Shaping(mode="prm_gated_opd")


# --------------------------------------------------------------------------- config and CLI
def test_config_keys(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "worker": {"keep_scorer_channels": True},
                "trainer": {"combined_mode": "prm_gated_opd", "opd_scorer": "teacher"},
            }
        )
    )
    cfg = load_config(path, environ={})
    assert cfg.worker.keep_scorer_channels and cfg.trainer.combined_mode == "prm_gated_opd"
    assert cfg.trainer.opd_scorer == "teacher"
    defaults = load_config(None, environ={})
    assert not defaults.worker.keep_scorer_channels and defaults.trainer.combined_mode is None
    assert defaults.trainer.opd_scorer == "opd_teacher" and defaults.prm.advantage_shaping.mode == "additive"
    env = load_config(
        None, environ={"PRM_TRAINER_COMBINED_MODE": "prm_weighted_opd", "PRM_WORKER_KEEP_SCORER_CHANNELS": "true"}
    )
    assert env.trainer.combined_mode == "prm_weighted_opd" and env.worker.keep_scorer_channels
    path.write_text(yaml.safe_dump({"trainer": {"combined_mode": "gvpo"}}))
    with pytest.raises(ConfigError, match="combined_mode"):
        load_config(path, environ={})


def test_cli_combined_mode(tmp_path) -> None:
    from prm_pipeline.cli import build_parser
    from shaper.trainer import _configure

    parser = build_parser()
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"combined_mode": "prm_gated_opd"}}))
    assert (
        _configure(parser.parse_args(["trainer", "--combined-mode", "prm_weighted_opd"])).trainer.combined_mode
        == "prm_weighted_opd"
    )
    assert _configure(parser.parse_args(["--config", str(path), "trainer"])).trainer.combined_mode == "prm_gated_opd"
    assert (
        _configure(
            parser.parse_args(["--config", str(path), "trainer", "--combined-mode", "none"])
        ).trainer.combined_mode
        is None
    )
    path.write_text(
        yaml.safe_dump({"actor": {"token_rewards_as_adv": True}, "trainer": {"combined_mode": "prm_gated_opd"}})
    )
    with pytest.raises(ConfigError, match="process_weighted"):
        _configure(parser.parse_args(["--config", str(path), "trainer", "--mode", "process_weighted"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["trainer", "--combined-mode", "additive"])


# CUDA where the machine has it (the trainer's case), else the CPU: results stay on
# the inputs' device and equal the CPU reference either way.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_combined_modes_run_on_the_inputs_device() -> None:
    batch = combined_batch()
    for mode in ("prm_gated_opd", "prm_weighted_opd"):
        cpu = shape_batch(batch, Shaping(mode="additive"), Trainer(combined_mode=mode, exclude_neutral_turns=True))
        gpu = shape_batch(
            batch.to(DEVICE), Shaping(mode="additive"), Trainer(combined_mode=mode, exclude_neutral_turns=True)
        )
        assert gpu.advantages.device.type == DEVICE
        torch.testing.assert_close(gpu.advantages.cpu(), cpu.advantages)
        assert gpu.loss_mask.cpu().tolist() == cpu.loss_mask.tolist()
