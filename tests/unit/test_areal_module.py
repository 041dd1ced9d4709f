"""An AReaL scorer module, written against AReaL's API, runs here with only its import
line changed; and AReaL's example path prefers the user's own module."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from scoring_workers.prm import PRMRunner
from scoring_workers.scorers import LengthBudgetScorer as BuiltIn
from tests.unit.test_prm_runner import traj, turn

# Written as for AReaL (`from areal.reward.prm import ...`); only that import line differs.
AREAL_MODULE = """
import torch

from scoring_workers.prm import BaseScorer, BaseTrajectoryScorer, PRMMetricObservation, PRMScorerResult


class LengthBudgetScorer(BaseScorer):
    name = "user_length_budget"

    def __init__(self, weight=1.0, enabled=True, max_output_tokens=128):
        super().__init__(weight=weight, enabled=enabled)
        self.max_output_tokens = max_output_tokens

    async def evaluate(self, interaction, ctx):
        n = interaction.model_response.output_len
        return 1.0 if n <= self.max_output_tokens else -1.0

    def prepare_result(self, interaction, result, ctx):
        over = interaction.model_response.output_len > self.max_output_tokens
        return PRMScorerResult(
            reward=result,
            observations=(
                PRMMetricObservation(
                    metric_id="over_budget", scope="turn", target_id=interaction.interaction_id,
                    value=over, value_type="boolean", aggregations=("count", "rate"),
                ),
            ),
        )


class DenseScorer(BaseScorer):
    name = "dense"

    async def evaluate(self, interaction, ctx):
        n = interaction.model_response.output_len
        return torch.linspace(0.0, 1.0, n)


class LastTurnBonus(BaseTrajectoryScorer):
    name = "last_turn_bonus"

    async def evaluate_trajectory(self, interactions, ctx):
        return {interactions[-1].interaction_id: 0.5}
"""


@pytest.fixture(autouse=True)
def _forget_examples_modules() -> Iterator[None]:
    """Each test imports ``examples.*`` afresh and leaves no user module behind."""
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "examples" or m.startswith("examples.")}
    yield
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.fixture
def user_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "examples" / "prm"
    package.mkdir(parents=True)
    (tmp_path / "examples" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "scorers.py").write_text(textwrap.dedent(AREAL_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


async def test_areal_module_runs_unchanged_but_for_its_import(user_examples: Path) -> None:
    config = {
        "scorers": [
            {"path": "examples.prm.scorers.LengthBudgetScorer", "weight": 1.0, "kwargs": {"max_output_tokens": 3}},
            {"path": "examples.prm.scorers.DenseScorer", "weight": 2.0},
            {"path": "examples.prm.scorers.LastTurnBonus"},
        ]
    }
    runner = await PRMRunner.create(config)
    try:
        assert [type(s).__module__ for s in runner.scorers] == ["examples.prm.scorers"] * 3
        result = await runner.run(traj(turn("a", n=3), turn("b", "a", n=5)))
    finally:
        await runner.aclose()
    (branch,) = result.branches
    # a: budget +1, dense 2*[0, .5, 1]; b: budget -1, dense 2*[0, .25, .5, .75, 1], bonus .5
    assert branch.token_rewards["a"].tolist() == [1.0, 2.0, 3.0]
    assert branch.token_rewards["b"].tolist() == [-0.5, 0.0, 0.5, 1.0, 1.5]
    assert branch.scorer_totals == {
        "user_length_budget": 0.0,
        "dense": 2.0,
        "last_turn_bonus": 0.5,
    }  # turn reward = mean
    stats = result.stats()
    assert stats["rollout/prm_metric/turn/user_length_budget/over_budget/count"] == 1.0
    assert stats["rollout/prm_metric/turn/user_length_budget/over_budget/rate"] == 0.5


async def test_areal_example_path_prefers_the_users_module(user_examples: Path) -> None:
    runner = await PRMRunner.create({"scorers": [{"path": "examples.prm.scorers.LengthBudgetScorer"}]})
    try:
        assert runner.scorers[0].name == "user_length_budget"
    finally:
        await runner.aclose()


async def test_areal_example_path_falls_back_to_the_builtin() -> None:
    runner = await PRMRunner.create({"scorers": [{"path": "examples.prm.scorers.LengthBudgetScorer"}]})
    try:
        assert type(runner.scorers[0]) is BuiltIn
    finally:
        await runner.aclose()
