"""OpenClaw-RL's online per-session rule (:mod:`shaper.online`) against OpenClaw-RL's own
bookkeeping: ``exclude = not has_next_state or score == 0``; an excluded turn with a next
state is kept when the session has no included sample so far; ``session_done`` clears
the count."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from infra.config import PRMAdvantageShapingConfig, TrainerConfig
from infra.schema import TurnSample, decode_turn_sample, encode, pack_array
from shaper import build_training_batch
from shaper.batch import collate
from shaper.online import OnlineTurnRule, export_sample, sample_advantages, sample_key
from shaper.trainer import shape_batch, shape_samples
from tests.unit.test_exclusion import group, linear


def sample(
    turn: int, score: float, has_next: bool = True, *, last: bool = False, session: str = "s", n: int = 3
) -> TurnSample:
    return TurnSample(
        session_id=session,
        trajectory_id=f"t-{session}",
        group_id="g",
        interaction_id=f"i{turn}",
        turn=turn,
        scorer="openclaw_prm",
        score=score,
        has_next_state=has_next,
        last=last,
        prompt_tokens_raw=pack_array([1, 2], np.dtype("<i4")),
        output_tokens_raw=pack_array(list(range(n)), np.dtype("<i4")),
    )


def upstream(events: list[tuple[float, bool, bool]]) -> list[bool]:
    """OpenClaw-RL's proxy, transcribed: a per-session counter of submitted effective
    samples, checked and bumped as each judged turn is submitted; session_done resets it."""
    counter = 0
    out = []
    for score, has_next, done in events:
        exclude = not has_next or score == 0
        if exclude and has_next and counter == 0:
            exclude = False
        if not exclude:
            counter += 1
        out.append(not exclude)
        if done:
            counter = 0
    return out


def test_decisions_match_openclaw_rl_over_random_sessions() -> None:
    rng = np.random.default_rng(0)
    for seed in range(500):
        rule = OnlineTurnRule()
        events = []
        for _ in range(int(rng.integers(1, 12))):
            done = rng.random() < 0.15
            has_next = not done and rng.random() < 0.85
            events.append((float(rng.choice([-1.0, 0.0, 1.0])) if has_next else 0.0, has_next, done))
        got = [
            rule.decide(sample(k + 1, score, has_next, last=done)).train
            for k, (score, has_next, done) in enumerate(events)
        ]
        assert got == upstream(events), (seed, events)


def test_a_leading_neutral_turn_is_kept_even_when_a_later_one_is_effective() -> None:
    rule = OnlineTurnRule()
    first, second, third = (rule.decide(sample(k, s)) for k, s in ((1, 0.0), (2, 1.0), (3, 0.0)))
    assert (first.train, first.rescued) == (True, True)
    assert (second.train, second.rescued) == (True, False)
    assert not third.train
    assert not rule.decide(sample(4, 0.0, False, last=True)).train


def test_a_turn_without_next_state_is_never_rescued() -> None:
    rule = OnlineTurnRule()
    assert not rule.decide(sample(1, 0.0, False)).train
    assert rule.decide(sample(2, -1.0)).train  # effective: kept on its own
    assert not rule.decide(sample(3, 0.0)).train


def test_session_done_clears_the_count_and_forgets_the_session() -> None:
    rule = OnlineTurnRule()
    assert rule.decide(sample(1, 1.0)).train
    assert not rule.decide(sample(2, 0.0, False, last=True)).train
    assert len(rule) == 0
    late = rule.decide(sample(3, 0.0))  # a judge task that finished after session_done
    assert late.train and late.rescued


def test_a_redelivered_sample_gets_its_first_decision() -> None:
    rule = OnlineTurnRule()
    rule.decide(sample(1, 0.0))
    again = rule.decide(sample(1, 0.0))
    assert again.train and again.rescued and again.duplicate
    assert not rule.decide(sample(2, 0.0)).train  # the repeat did not count twice, nor reset


def test_sessions_are_separate_and_memory_is_bounded() -> None:
    rule = OnlineTurnRule(max_sessions=2)
    for s in ("a", "b", "c"):
        assert rule.decide(sample(1, 1.0, session=s)).train
    assert len(rule) == 2
    assert rule.decide(sample(2, 0.0, session="a")).rescued  # "a" was forgotten: starts from zero
    assert not rule.decide(sample(2, 0.0, session="c")).train


def test_advantage_is_the_score_over_the_response_masked_when_excluded() -> None:
    rule = OnlineTurnRule()
    kept = sample(1, -1.0, n=4)
    adv, mask = sample_advantages(kept, rule.decide(kept))
    assert adv.tolist() == [-1.0] * 4 and mask.all()
    dropped = sample(2, 0.0, n=2)
    adv, mask = sample_advantages(dropped, rule.decide(dropped))
    assert adv.tolist() == [0.0, 0.0] and not mask.any()


def test_a_turn_sample_round_trips_and_is_checked() -> None:
    s = sample(2, 1.0)
    value, headers = encode(s)
    assert dict(headers)["prm-kind"] == b"turn_sample"
    assert decode_turn_sample(value, headers) == s
    with pytest.raises(ValueError, match="turn must be >= 1"):
        sample(0, 1.0)
    with pytest.raises(ValueError, match="score must be finite"):
        sample(1, float("inf"))


def test_a_sample_is_one_row_of_a_group_of_one() -> None:
    """Prompt then output; the output in the loss with the score on it; outcome reward = score."""
    s = msgspec.structs.replace(
        sample(2, -1.0, n=3), output_logprobs_raw=pack_array([-0.5, -0.25, -1.0], np.dtype("<f4"))
    )
    group = export_sample(s)
    (row,) = group.rows
    assert group.group_id == "g/i2" and (row.trajectory_id, row.leaf_id) == ("t-s", "i2")
    assert row.input_ids.tolist() == [1, 2, 0, 1, 2]
    assert row.loss_mask.tolist() == [False, False, True, True, True]
    assert row.token_rewards.tolist() == [0.0, 0.0, -1.0, -1.0, -1.0]
    assert row.logprobs.tolist() == [0.0, 0.0, -0.5, -0.25, -1.0]
    assert row.turn_index.tolist() == [-1, -1, 0, 0, 0]
    assert row.reward == -1.0
    assert sample_key(s) == ("default", "t-s/i2", 0)


def test_online_samples_shape_as_the_recipe_shapes_a_kept_turn_of_a_verdict() -> None:
    """``shape_samples`` of a sample = ``shape_batch`` with ``recipe: openclaw_turns`` of the same
    turn kept in a verdict: the score over the response (next-token aligned), no outcome term."""
    verdict = group("g", [linear("one", [(1.0, True), (0.0, True), (0.0, False)])])  # t0 kept: effective
    batch = build_training_batch([verdict])
    recipe = shape_batch(batch, PRMAdvantageShapingConfig(mode="additive"), TrainerConfig(recipe="openclaw_turns"))
    turn0 = (batch.turn_index[0] == 0).nonzero().flatten().tolist()
    prompt = batch.input_ids[0, : turn0[0]].tolist()
    out = batch.input_ids[0, turn0[0] : turn0[-1] + 1].tolist()
    online = msgspec.structs.replace(
        sample(1, 1.0),
        prompt_tokens_raw=pack_array(prompt, np.dtype("<i4")),
        output_tokens_raw=pack_array(out, np.dtype("<i4")),
    )
    shaped = shape_samples(collate([export_sample(online)]))
    width = len(prompt) + len(out)
    assert shaped.advantages[0].tolist() == recipe.advantages[0, :width].tolist()
    assert shaped.loss_mask[0].tolist() == recipe.loss_mask[0, :width].tolist()
    assert not shaped.outcome_advantages.any()
