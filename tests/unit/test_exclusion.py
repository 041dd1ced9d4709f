"""OpenClaw-RL's neutral-turn exclusion (shaper.exclusion) on hand-built verdicts and tensors.

Row layout of the three-turn sessions used throughout (concat export)::

    position    0 1 2 | 3 4 | 5 | 6 7 | 8 | 9 10 11
    what        prompt| t0  | d | t1  | d | t2
    turn_index  -1    | 0   |-1 | 1   |-1 | 2

The builders at the top are shared with tests/unit/test_channels.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
import yaml

from infra.config import PRMAdvantageShapingConfig as Shaping
from infra.config import TrainerConfig as Trainer
from infra.config import load_config
from infra.schema import (
    BranchResult,
    GroupVerdict,
    Interaction,
    ModelResponse,
    PRMMetricObservation,
    PRMTurnResult,
    SessionResult,
    TokenRewards,
    compact_turns,
)
from shaper import build_training_batch
from shaper.exclusion import apply_exclusion, exclude_neutral_turns, judge_turn_table, session_index
from shaper.shaping import shift_token_rewards
from shaper.trainer import shape_batch

JUDGE = "openclaw_judge"
OTHER = "length_budget"
T0_POS, T1_POS, T2_POS = [3, 4], [6, 7], [9, 10, 11]
ROW_LEN = 12


# --------------------------------------------------------------------------- builders
def turn(iid: str, parent: str | None, inp: Sequence[int], out: Sequence[int]) -> Interaction:
    return Interaction(
        interaction_id=iid,
        parent_id=parent,
        model_response=ModelResponse.from_arrays(
            np.asarray(inp, np.int32), np.asarray(out, np.int32), np.full(len(out), -0.5, np.float32), "stop"
        ),
    )


def three_turns(sid: str) -> list[Interaction]:
    return [
        turn(f"{sid}-t0", None, [1, 2, 3], [4, 5]),
        turn(f"{sid}-t1", f"{sid}-t0", [1, 2, 3, 4, 5, 6], [7, 8]),
        turn(f"{sid}-t2", f"{sid}-t1", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12]),
    ]


def forked(sid: str) -> list[Interaction]:
    """t0 with two children t1 and t1b: rows [t0, t1] and [t0, t1b] (positions as above)."""
    return [
        turn(f"{sid}-t0", None, [1, 2, 3], [4, 5]),
        turn(f"{sid}-t1", f"{sid}-t0", [1, 2, 3, 4, 5, 6], [7, 8]),
        turn(f"{sid}-t1b", f"{sid}-t0", [1, 2, 3, 4, 5, 16], [17, 18]),
    ]


def judge_result(iid: str, score: float, has_next: bool, scorer: str = JUDGE) -> PRMTurnResult:
    obs = PRMMetricObservation(
        metric_id="has_next_state",
        scope="turn",
        target_id=iid,
        value=has_next,
        value_type="boolean",
        aggregations=("count", "rate"),
    )
    return PRMTurnResult(interaction_id=iid, scorer_name=scorer, reward=score, observations=(obs,))


def scored_session(
    sid: str,
    interactions: Sequence[Interaction],
    judged: Mapping[str, Sequence[tuple[float, bool]]],
    *,
    outcome: float = 1.0,
    channels: Mapping[str, Mapping[str, Mapping[str, TokenRewards]]] | None = None,
) -> SessionResult:
    """A scored member as a worker would publish it, with scorers ``(OTHER, JUDGE)`` in that order.

    ``judged`` maps each leaf id to ``(score, has_next_state)`` per turn of its path;
    ``channels`` optionally maps a leaf id to that branch's channels.
    """
    by_id = {i.interaction_id: i for i in interactions}
    branches: list[BranchResult] = []
    results: list[PRMTurnResult] = []
    for leaf, turns in judged.items():
        path = [leaf]
        while by_id[path[0]].parent_id is not None:
            path.insert(0, by_id[path[0]].parent_id)
        assert len(path) == len(turns), (leaf, path)
        lengths = {iid: by_id[iid].model_response.output_len for iid in path}
        branches.append(
            BranchResult(
                leaf_id=leaf,
                path=path,
                token_rewards={
                    iid: TokenRewards(length=lengths[iid], uniform=float(s)) for iid, (s, _) in zip(path, turns)
                },
                scorer_totals={OTHER: 0.0, JUDGE: float(sum(s for s, _ in turns))},
                channels=dict((channels or {}).get(leaf, {})),
            )
        )
        results += [PRMTurnResult(interaction_id=iid, scorer_name=OTHER, reward=0.0) for iid in path]
        results += [judge_result(iid, s, h) for iid, (s, h) in zip(path, turns)]
    return SessionResult(
        session_id=sid,
        trajectory_id=f"traj-{sid}",
        status="scored",
        outcome_reward=outcome,
        branches=branches,
        turn_results=results,
        turns=compact_turns(interactions),
    )


def group(gid: str, sessions: Sequence[SessionResult]) -> GroupVerdict:
    return GroupVerdict(group_id=gid, status="accepted", group_size=len(sessions), sessions=list(sessions))


def linear(sid: str, turns: Sequence[tuple[float, bool]], **kwargs) -> SessionResult:
    return scored_session(sid, three_turns(sid), {f"{sid}-t2": turns}, **kwargs)


def mask_at(*positions: Sequence[int], length: int = ROW_LEN) -> list[bool]:
    out = [False] * length
    for block in positions:
        for p in block:
            out[p] = True
    return out


# --------------------------------------------------------------------------- through verdicts
CASES = {
    # name: (judge (score, has_next_state) per turn, positions kept)
    "mixed": ([(1.0, True), (0.0, True), (0.0, False)], [T0_POS]),  # neutral t1 and last t2 out
    "all_neutral": ([(0.0, True), (0.0, True), (0.0, False)], [T0_POS]),  # at-least-one: first judged turn
    "first_without_next": ([(0.0, False), (0.0, True), (0.0, False)], [T1_POS]),  # first *with* a next state
    "no_candidate": ([(0.0, False), (0.0, False), (0.0, False)], []),  # nothing was judged: nothing kept
    "negative_is_effective": ([(-1.0, True), (0.0, True), (0.0, False)], [T0_POS]),
    "late_effective": ([(0.0, True), (0.0, True), (1.0, True)], [T2_POS]),  # no rescue: t2 is effective
    "all_effective": ([(1.0, True), (-1.0, True), (1.0, True)], [T0_POS, T1_POS, T2_POS]),
}


def cases_batch():
    verdicts = [group(f"g-{name}", [linear(name, turns)]) for name, (turns, _) in CASES.items()]
    return build_training_batch(verdicts)


def test_exclusion_through_verdicts_matches_hand_computed_masks() -> None:
    batch = cases_batch()
    assert batch.session_ids == list(CASES)
    assert batch.turn_index[0].tolist() == [-1, -1, -1, 0, 0, -1, 1, 1, -1, 2, 2, 2]
    assert batch.loss_mask.tolist() == [mask_at(T0_POS, T1_POS, T2_POS)] * len(CASES)
    out = apply_exclusion(batch)
    assert out.dtype == torch.bool
    for row, (name, (_, kept)) in enumerate(CASES.items()):
        assert out[row].tolist() == mask_at(*kept), name
    assert batch.loss_mask.tolist() == [mask_at(T0_POS, T1_POS, T2_POS)] * len(CASES)  # input untouched


def test_judge_turn_table_reads_scores_and_has_next_state() -> None:
    table = judge_turn_table(cases_batch())
    assert table.scores.tolist()[0] == [1.0, 0.0, 0.0]
    assert table.has_next_state.tolist()[2] == [False, True, False]
    assert table.judged.all()


def test_shape_batch_applies_exclusion_before_the_shift() -> None:
    batch = cases_batch()
    plain = shape_batch(batch, Shaping(mode="additive"))
    shaped = shape_batch(batch, Shaping(mode="additive"), Trainer(exclude_neutral_turns=True))
    expected = shift_token_rewards(apply_exclusion(batch))
    assert shaped.loss_mask.tolist() == expected.tolist()
    assert plain.loss_mask.tolist() == shift_token_rewards(batch.loss_mask).tolist()
    # excluded positions carry no advantage at all (outcome and process signal)
    assert (shaped.advantages[~shaped.loss_mask] == 0).all()
    assert shaped.loss_mask.sum() < plain.loss_mask.sum()


def test_rows_of_one_session_share_the_guarantee() -> None:
    # Session "fk": every turn of both rows neutral -> only row 0's t0 is rescued (row order, then turn).
    # Session "fe": row 1's t0 (branch-local next state) scored 1 -> the session is effective, no rescue.
    fk = scored_session(
        "fk", forked("fk"), {"fk-t1": [(0.0, True), (0.0, False)], "fk-t1b": [(0.0, True), (0.0, False)]}
    )
    fe = scored_session(
        "fe", forked("fe"), {"fe-t1": [(0.0, True), (0.0, False)], "fe-t1b": [(1.0, True), (0.0, False)]}
    )
    batch = build_training_batch([group("g", [fk, fe])])
    assert batch.session_ids == ["fk", "fk", "fe", "fe"]
    out = apply_exclusion(batch)
    assert out.tolist() == [mask_at(T0_POS, length=8), mask_at(length=8), mask_at(length=8), mask_at(T0_POS, length=8)]


def test_same_session_id_in_two_groups_is_two_sessions() -> None:
    a = group("ga", [linear("s", [(0.0, True), (0.0, True), (0.0, False)])])
    b = group("gb", [linear("s", [(0.0, True), (0.0, True), (0.0, False)])])
    out = apply_exclusion(build_training_batch([a, b]))
    assert out.tolist() == [mask_at(T0_POS), mask_at(T0_POS)]  # each keeps its own first turn


def test_wrong_judge_scorer_is_refused_with_the_fix() -> None:
    batch = cases_batch()
    with pytest.raises(ValueError, match=r"no per-turn results of scorer 'prm_judge'.*trainer.judge_scorer"):
        apply_exclusion(batch, scorer="prm_judge")
    with pytest.raises(ValueError, match="trainer.judge_scorer"):
        shape_batch(batch, Shaping(mode="additive"), Trainer(exclude_neutral_turns=True, judge_scorer="prm_judge"))


def test_verdict_without_aligned_turn_results_is_refused() -> None:
    s = linear("s", [(1.0, True), (0.0, True), (0.0, False)])
    import msgspec

    broken = msgspec.structs.replace(s, turn_results=s.turn_results[:-1])  # one judge result short
    batch = build_training_batch([group("g", [broken])])
    assert batch.turn_results == [{}]
    with pytest.raises(ValueError, match="has no per-turn results"):
        apply_exclusion(batch)


# --------------------------------------------------------------------------- the pure function
def test_pure_function_on_raw_tensors() -> None:
    # Two rows, two sessions. Row 0: turns 0..2 = [neutral, unjudged, no next state]: the
    # unjudged turn keeps its mask and is not effective -> the neutral turn 0 is rescued.
    # Row 1: numeric mask with a masked-out token inside turn 1, which must stay 0.
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 0]], dtype=torch.float32)
    turn_index = torch.tensor([[-1, 0, 1, 1, 2, -1], [0, 0, 1, 1, 1, -1]])
    scores = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
    has_next = torch.tensor([[True, True, False], [True, True, True]])
    judged = torch.tensor([[True, False, True], [True, True, False]])
    out = exclude_neutral_turns(loss_mask, turn_index, scores, has_next, torch.tensor([0, 1]), judged)
    assert out.tolist() == [[False, True, True, True, False, False], [True, True, False, False, False, False]]


def test_pure_function_pools_rows_by_session_index() -> None:
    loss_mask = torch.ones(3, 2, dtype=torch.bool)
    turn_index = torch.tensor([[0, 1]] * 3)
    scores = torch.zeros(3, 2)
    has_next = torch.tensor([[False, True], [True, True], [True, False]])
    # rows 0 and 2 are one session (first candidate: row 0 turn 1); row 1 is alone (its turn 0)
    out = exclude_neutral_turns(loss_mask, turn_index, scores, has_next, torch.tensor([0, 1, 0]))
    assert out.tolist() == [[False, True], [True, False], [False, False]]
    assert session_index(["g", "g", "h", "g"], ["a", "b", "a", "a"]).tolist() == [0, 1, 2, 0]


def test_pure_function_checks_its_inputs() -> None:
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"turn_index must lie in \[-1, K\)"):
        exclude_neutral_turns(
            mask, torch.tensor([[0, 1, 2]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.tensor([0])
        )
    with pytest.raises(ValueError, match="integer"):
        exclude_neutral_turns(
            mask, torch.zeros(1, 3), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), torch.tensor([0])
        )
    with pytest.raises(ValueError, match=r"sessions must be \[B\]"):
        exclude_neutral_turns(
            mask,
            torch.zeros(1, 3, dtype=torch.long),
            torch.zeros(1, 1),
            torch.ones(1, 1, dtype=torch.bool),
            torch.tensor([0, 1]),
        )
    empty = exclude_neutral_turns(
        torch.zeros(0, 0, dtype=torch.bool),
        torch.zeros(0, 0, dtype=torch.long),
        torch.zeros(0, 0),
        torch.zeros(0, 0, dtype=torch.bool),
        torch.zeros(0, dtype=torch.long),
    )
    assert empty.shape == (0, 0)


# CUDA where the machine has it (the trainer's case), else the CPU: results stay on
# the inputs' device and equal the CPU reference either way.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_exclusion_runs_on_the_inputs_device() -> None:
    batch = cases_batch()
    cpu = apply_exclusion(batch)
    gpu = apply_exclusion(batch.to(DEVICE))
    assert gpu.device.type == DEVICE and gpu.cpu().tolist() == cpu.tolist()


# --------------------------------------------------------------------------- config and CLI
def test_config_keys_and_env_override(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"exclude_neutral_turns": True, "judge_scorer": "my_judge"}}))
    cfg = load_config(path, environ={})
    assert cfg.trainer.exclude_neutral_turns and cfg.trainer.judge_scorer == "my_judge"
    default = load_config(None, environ={})
    assert not default.trainer.exclude_neutral_turns and default.trainer.judge_scorer == "openclaw_judge"
    env = load_config(None, environ={"PRM_TRAINER_EXCLUDE_NEUTRAL_TURNS": "true"})
    assert env.trainer.exclude_neutral_turns


def test_cli_flag_overrides_the_config(tmp_path) -> None:
    from prm_pipeline.cli import build_parser
    from shaper.trainer import _configure

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"exclude_neutral_turns": True}}))
    parser = build_parser()
    on = _configure(parser.parse_args(["trainer", "--exclude-neutral-turns"]))
    assert on.trainer.exclude_neutral_turns
    off = _configure(parser.parse_args(["--config", str(path), "trainer", "--no-exclude-neutral-turns"]))
    assert not off.trainer.exclude_neutral_turns
    kept = _configure(parser.parse_args(["--config", str(path), "trainer"]))
    assert kept.trainer.exclude_neutral_turns
