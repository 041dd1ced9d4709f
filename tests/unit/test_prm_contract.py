"""The scorer contract: public API, BaseScorer, results, observations, resolution,
the built-in LengthBudgetScorer and the worked example in ``examples/``."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import infra.config
import infra.schema
from infra.schema import Interaction, ModelResponse, ReadyTrajectory
from scoring_workers.prm import (
    SCORER_ALIASES,
    BaseScorer,
    BaseTrajectoryScorer,
    PRMAdvantageShapingConfig,
    PRMConfig,
    PRMMetricObservation,
    PRMRunner,
    PRMScorerConfig,
    PRMScorerResult,
    PRMTurnResult,
    ScoredTrajectory,
    build_scorer,
    resolve_scorer_class,
)
from scoring_workers.prm._frozen import FrozenDict, freeze
from scoring_workers.scorers import LengthBudgetScorer

REPO = Path(__file__).resolve().parents[2]


def turn(iid: str, parent: str | None = None, n: int = 4) -> Interaction:
    return Interaction(
        interaction_id=iid,
        parent_id=parent,
        messages=[{"role": "user", "content": f"q-{iid}"}],
        output_message_list=[{"role": "assistant", "content": f"a-{iid}"}],
        model_response=ModelResponse.from_arrays(np.arange(3), np.arange(n)),
    )


def traj(*interactions: Interaction, is_eval: bool = False) -> ReadyTrajectory:
    return ReadyTrajectory(
        trajectory_id="traj-1",
        session_id="sess-1",
        group_id="g",
        group_size=1,
        interactions=list(interactions),
        outcome_reward=1.0,
        is_eval=is_eval,
    )


class Half(BaseScorer):
    name = "half"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return 0.5


# ----------------------------------------------------------------------------- public API
def test_public_api_names_and_reexports() -> None:
    import scoring_workers.prm as prm

    for name in (
        "BaseScorer",
        "BaseTrajectoryScorer",
        "PRMScorerResult",
        "PRMMetricObservation",
        "PRMTurnResult",
        "PRMRunner",
        "ScoredTrajectory",
        "PRMConfig",
        "PRMScorerConfig",
        "PRMAdvantageShapingConfig",
        "failure_code",
        "failure_detail",
    ):
        assert name in prm.__all__ and hasattr(prm, name), name
    assert PRMMetricObservation is infra.schema.PRMMetricObservation
    assert PRMTurnResult is infra.schema.PRMTurnResult
    assert PRMConfig is infra.config.PRMConfig
    assert PRMScorerConfig is infra.config.PRMScorerConfig
    assert PRMAdvantageShapingConfig is infra.config.PRMAdvantageShapingConfig


def test_config_types_as_in_the_issue() -> None:
    config = PRMConfig(
        enabled=True,
        scorers=[PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 64})],
        advantage_shaping=PRMAdvantageShapingConfig(mode="additive", negative_scale=0.2, zero_penalty=0.4),
    )
    entry = config.scorers[0]
    assert (entry.weight, entry.enabled, entry.kwargs) == (1.0, True, {"max_output_tokens": 64})
    assert PRMScorerConfig("a.B").kwargs == {}
    runner = PRMRunner(config)
    (scorer,) = runner.scorers
    assert type(scorer) is LengthBudgetScorer and scorer.max_output_tokens == 64


@pytest.mark.slow  # a fresh Python process
def test_import_is_light() -> None:
    code = (
        "import sys, scoring_workers.prm, scoring_workers.scorers, scoring_workers.scorers.length_budget;"
        "heavy = [m for m in ('httpx', 'aiohttp', 'requests', 'aiokafka', 'kafka', 'redis', 'openai') if m in sys.modules];"
        "print(','.join(heavy) or 'none')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "none"


# ----------------------------------------------------------------------------- BaseScorer
def test_base_scorer_requires_class_level_name() -> None:
    class NoName(BaseScorer):
        async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
            return 0.0

    class Blank(NoName):
        name = "  "

    with pytest.raises(ValueError, match="non-empty class-level `name`"):
        NoName()
    with pytest.raises(ValueError, match="non-empty class-level `name`"):
        Blank()


def test_base_scorer_init_defaults_and_checks() -> None:
    scorer = Half()
    assert (scorer.weight, scorer.enabled, scorer.version) == (1.0, True, "1")
    scorer = Half(weight=2, enabled=False)
    assert (scorer.weight, scorer.enabled) == (2.0, False) and isinstance(scorer.weight, float)
    with pytest.raises(ValueError, match="finite"):
        Half(weight=float("nan"))
    with pytest.raises(TypeError):
        Half(weight="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Half(enabled=1)  # type: ignore[arg-type]


async def test_base_scorer_evaluate_must_be_implemented() -> None:
    class Lazy(BaseScorer):
        name = "lazy"

    with pytest.raises(NotImplementedError):
        await Lazy().evaluate(object(), {})


def test_prepare_result_wraps_raw_reward() -> None:
    scorer = Half()
    wrapped = scorer.prepare_result(object(), 0.25, {})
    assert wrapped == PRMScorerResult(0.25, ())
    ready = PRMScorerResult(1.0)
    assert scorer.prepare_result(object(), ready, {}) is ready
    assert scorer.prepare_result(object(), None, {}) is None
    tensor = torch.tensor([1.0, 2.0])
    assert scorer.prepare_result(object(), tensor, {}).reward is tensor


async def test_evaluate_result_is_evaluate_then_prepare_result() -> None:
    calls: list[tuple[str, Any]] = []

    class Traced(BaseScorer):
        name = "traced"

        async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
            calls.append(("evaluate", interaction))
            return 0.75

        def prepare_result(self, interaction: Any, result: Any, ctx: dict[str, Any]) -> PRMScorerResult | None:
            calls.append(("prepare", result))
            return PRMScorerResult(result * 2)

    result = await Traced().evaluate_result("turn-x", {"k": 1})
    assert calls == [("evaluate", "turn-x"), ("prepare", 0.75)]
    assert result == PRMScorerResult(1.5)


async def test_aclose_default_is_noop() -> None:
    scorer = Half()
    assert await scorer.aclose() is None
    assert await scorer.aclose() is None


def test_prm_scorer_result_checks_its_fields() -> None:
    obs = PRMMetricObservation(
        metric_id="m", scope="turn", target_id="a", value=1.0, value_type="float", aggregations=("sum",)
    )
    assert PRMScorerResult(0.0, [obs]).observations == (obs,)  # lists become tuples
    with pytest.raises(TypeError, match="return None from evaluate"):
        PRMScorerResult(None)
    with pytest.raises(TypeError, match="PRMMetricObservation"):
        PRMScorerResult(0.0, ({"metric_id": "m"},))  # type: ignore[arg-type]


async def test_trajectory_scorer_evaluate_directly_is_an_error() -> None:
    class Joint(BaseTrajectoryScorer):
        name = "joint"

        async def evaluate_trajectory(self, interactions: Any, ctx: dict[str, Any]) -> dict[str, float]:
            return {}

    with pytest.raises(RuntimeError, match="evaluate_trajectory"):  # AReaL's type
        await Joint().evaluate(turn("a"), {})
    with pytest.raises(RuntimeError, match="evaluate_trajectory"):
        await Joint().evaluate_result(turn("a"), {})


# ----------------------------------------------------------------------------- observations
def _obs(**overrides: Any) -> PRMMetricObservation:
    fields = dict(
        metric_id="m", scope="turn", target_id="a", value=True, value_type="boolean", aggregations=("count", "rate")
    )
    fields.update(overrides)
    return PRMMetricObservation(**fields)


def test_observation_scope_and_value_type() -> None:
    assert _obs(scope="trajectory").scope == "trajectory"
    with pytest.raises(ValueError, match="scope"):
        _obs(scope="session")
    with pytest.raises(ValueError, match="value_type"):
        _obs(value_type="int")


def test_observation_aggregations_match_value_type() -> None:
    assert _obs(aggregations=("rate",)).aggregations == ("rate",)
    assert _obs(value=2.5, value_type="float", aggregations=("sum", "mean")).aggregations == ("sum", "mean")
    with pytest.raises(ValueError, match="allow count/rate"):
        _obs(aggregations=("mean",))
    with pytest.raises(ValueError, match="allow sum/mean"):
        _obs(value=1.0, value_type="float", aggregations=("rate",))
    with pytest.raises(ValueError, match="must not be empty"):
        _obs(aggregations=())
    with pytest.raises(ValueError, match="duplicate"):
        _obs(aggregations=("count", "count"))


def test_observation_shapes_remembered_as_valid_still_check_the_rest() -> None:
    _obs()  # the shape (turn, boolean, (count, rate)) is now known valid
    assert _obs(aggregations=["count", "rate"]).value is True  # a list cannot be looked up: checked in full
    with pytest.raises(ValueError, match="allow count/rate"):
        _obs(aggregations=["mean"])
    with pytest.raises(ValueError, match="must be a bool"):
        _obs(value=1.0)  # a known shape still checks its value
    with pytest.raises(ValueError, match="metric_id"):
        _obs(metric_id="")


def test_observation_value_matches_value_type() -> None:
    assert _obs(value=False).value is False
    assert _obs(value=3, value_type="float", aggregations=("sum",)).value == 3
    with pytest.raises(ValueError, match="must be a bool"):
        _obs(value=1)
    with pytest.raises(ValueError, match="int or float"):
        _obs(value=True, value_type="float", aggregations=("sum",))
    with pytest.raises(ValueError, match="finite"):
        _obs(value=float("inf"), value_type="float", aggregations=("sum",))


# ----------------------------------------------------------------------------- read-only inputs
def test_freeze_makes_nested_messages_read_only_but_json_friendly() -> None:
    original = [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}]
    frozen = freeze(original)
    assert isinstance(frozen, tuple) and isinstance(frozen[0], FrozenDict)
    assert isinstance(frozen[0]["tool_calls"], tuple) and isinstance(frozen[0]["tool_calls"][0]["function"], FrozenDict)
    with pytest.raises(TypeError, match="read-only"):
        frozen[0]["content"] = "y"
    with pytest.raises(TypeError, match="read-only"):
        frozen[0]["tool_calls"][0]["function"].update(name="g")
    assert json.loads(json.dumps(frozen)) == original
    assert json.loads(msgspec.json.encode(frozen)) == original
    private = copy.deepcopy(frozen)  # deepcopy hands back a plain, mutable copy
    private[0]["content"] = "mine"
    assert type(private[0]) is dict and frozen[0]["content"] == "x" and original[0]["content"] == "x"


# ----------------------------------------------------------------------------- resolution
def test_alias_resolves_seed_path_without_importing_examples() -> None:
    assert SCORER_ALIASES["examples.prm.scorers.LengthBudgetScorer"] == "scoring_workers.scorers.LengthBudgetScorer"
    assert resolve_scorer_class("examples.prm.scorers.LengthBudgetScorer") is LengthBudgetScorer
    assert "examples.prm" not in sys.modules
    assert not (REPO / "examples" / "prm" / "scorers.py").exists()  # nothing may shadow the alias


def test_resolve_by_import_path() -> None:
    assert resolve_scorer_class("scoring_workers.scorers.length_budget.LengthBudgetScorer") is LengthBudgetScorer
    with pytest.raises(ImportError, match="no attribute 'Nope'"):
        resolve_scorer_class("scoring_workers.scorers.length_budget.Nope")
    with pytest.raises(ModuleNotFoundError):
        resolve_scorer_class("no_such_module_xyz.Scorer")


def test_resolve_empty_or_malformed_path_is_value_error() -> None:
    for bad in ("", "   ", "NoDots"):
        with pytest.raises(ValueError):
            resolve_scorer_class(bad)


def test_resolve_non_scorer_class_is_type_error() -> None:
    with pytest.raises(TypeError, match="not a subclass"):
        resolve_scorer_class("collections.OrderedDict")
    with pytest.raises(TypeError, match="not a subclass"):
        resolve_scorer_class("math.pi")


def test_resolve_allowed_prefixes() -> None:
    allowed = ("scoring_workers.scorers",)
    assert (
        resolve_scorer_class("examples.prm.scorers.LengthBudgetScorer", allowed_prefixes=allowed) is LengthBudgetScorer
    )
    with pytest.raises(ValueError, match="refused"):
        resolve_scorer_class("collections.OrderedDict", allowed_prefixes=allowed)
    with pytest.raises(ValueError, match="refused"):  # prefixes match whole dotted components
        resolve_scorer_class("scoring_workers.scorers_evil.X", allowed_prefixes=allowed)
    assert "scoring_workers.scorers_evil" not in sys.modules
    with pytest.raises(ValueError, match="refused"):
        resolve_scorer_class("collections.OrderedDict", allowed_prefixes=[])


def test_build_scorer_owned_and_borrowed() -> None:
    instance = Half(weight=3.0)
    assert build_scorer(instance) == (instance, False)
    scorer, owned = build_scorer(
        {
            "path": "examples.prm.scorers.LengthBudgetScorer",
            "weight": 0.5,
            "enabled": False,
            "kwargs": {"max_output_tokens": 7},
        }
    )
    assert owned and (scorer.weight, scorer.enabled, scorer.max_output_tokens) == (0.5, False, 7)
    with pytest.raises(ValueError, match="unknown key `max_output_tokens`"):
        build_scorer({"path": "examples.prm.scorers.LengthBudgetScorer", "max_output_tokens": 7})
    with pytest.raises(TypeError, match="unexpected keyword"):
        build_scorer(PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", kwargs={"budget": 7}))
    with pytest.raises(TypeError):
        build_scorer(Half)  # a class, not an instance
    with pytest.raises(TypeError):
        build_scorer(object())  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- LengthBudgetScorer
def test_length_budget_defaults_and_refusals() -> None:
    scorer = LengthBudgetScorer()
    assert (scorer.name, scorer.max_output_tokens, scorer.weight) == ("length_budget", 128, 1.0)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="> 0"):
            LengthBudgetScorer(max_output_tokens=bad)
    with pytest.raises(TypeError):
        LengthBudgetScorer(max_output_tokens=True)


async def test_length_budget_reward_and_observation() -> None:
    scorer = LengthBudgetScorer(max_output_tokens=128)
    at = await scorer.evaluate_result(turn("a", n=128), {})
    over = await scorer.evaluate_result(turn("b", n=129), {})
    assert at.reward == 1.0 and over.reward == 0.0
    (obs,) = at.observations
    assert (obs.metric_id, obs.scope, obs.target_id, obs.value, obs.value_type, obs.aggregations) == (
        "within_budget",
        "turn",
        "a",
        True,
        "boolean",
        ("count", "rate"),
    )
    assert over.observations[0].value is False


async def test_length_budget_end_to_end_via_seed_path() -> None:
    runner = await PRMRunner.create(
        PRMConfig(
            scorers=[
                PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", weight=2.0, kwargs={"max_output_tokens": 5})
            ]
        )
    )
    scored = await runner.run(traj(turn("a", n=5), turn("b", "a", n=6)))
    assert isinstance(scored, ScoredTrajectory)
    (branch,) = scored.branches
    assert branch.token_rewards["a"].tolist() == [2.0] * 5 and branch.token_rewards["b"].tolist() == [0.0] * 6
    assert branch.scorer_totals == {"length_budget": 2.0}
    stats = scored.stats()
    assert stats["rollout/prm_metric/turn/length_budget/within_budget/count"] == 1.0
    assert stats["rollout/prm_metric/turn/length_budget/within_budget/rate"] == 0.5
    await runner.aclose()


# ----------------------------------------------------------------------------- examples/
def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "prm_custom_scorer_example", REPO / "examples" / "prm_custom_scorer.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


async def test_example_custom_scorers_run() -> None:
    example = _load_example()
    runner = await PRMRunner.create(example.example_config())
    tool_turn = Interaction(
        interaction_id="a",
        messages=[{"role": "user", "content": "hi"}],
        output_message_list=[
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}],
            }
        ],
        model_response=ModelResponse.from_arrays([1, 2], [5, 6, 7], [-0.1, -5.0, -0.2]),
    )
    answer_turn = Interaction(
        interaction_id="b",
        parent_id="a",
        messages=[{"role": "user", "content": "hi"}],
        output_message_list=[{"role": "assistant", "content": "ANSWER: 42"}],
        model_response=ModelResponse.from_arrays([1, 2, 5, 6, 7], [8, 9], [-0.1, -0.3]),
    )
    scored = await runner.run(traj(tool_turn, answer_turn))
    (branch,) = scored.branches
    stats = scored.stats()
    assert stats["rollout/prm_metric/turn/tool_use/valid_tool_call/count"] == 1.0
    assert stats["rollout/prm_metric/turn/tool_use/valid_tool_call/rate"] == 0.5
    assert stats["rollout/prm_metric/trajectory/tool_use/branch_turns/mean"] == 2.0
    assert stats["rollout/prm_metric/trajectory/final_answer/answered/rate"] == 1.0
    assert branch.scorer_totals["final_answer"] == 1.0
    # dense: token 2 of turn a has logprob -5.0 < -2.0 -> penalised (weight 0.5 * -1.0)
    assert branch.token_rewards["a"].tolist() == pytest.approx([0.5, 0.0, 0.5])
    await runner.aclose()


def test_examples_readme_snippet_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/README.md's end-to-end snippet runs as written (it once used an undefined name)."""
    text = (REPO / "examples" / "README.md").read_text()
    snippet = text[text.index("Try the example end to end") :].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(REPO)  # the snippet says: run from the repository root
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "prm_custom_scorer", raising=False)
    try:
        exec(compile(snippet, "examples/README.md", "exec"), {"__name__": "__main__"})
    finally:
        sys.modules.pop("prm_custom_scorer", None)
    printed = capsys.readouterr().out
    assert "rollout/prm_metric/turn/tool_use/valid_tool_call/rate = 0.5" in printed
    assert "rollout/prm_trajectory_reward/final_answer = 1" in printed


# --------------------------------------------------------------------------- streamed sessions
def test_only_scorers_that_declare_it_run_before_a_session_ends() -> None:
    from scoring_workers.scorers import OPDTeacherScorer, OpenClawJudgeScorer

    class ThirdParty(BaseScorer):
        name = "third_party"

        async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
            return 0.0

    assert not ThirdParty.streamable and not BaseTrajectoryScorer.streamable
    assert LengthBudgetScorer.streamable and OpenClawJudgeScorer.streamable and OPDTeacherScorer.streamable
    assert LengthBudgetScorer().stream_key(None, {}) is None  # reads nothing of the conversation


def test_a_judge_s_stream_key_is_the_next_state_it_would_judge() -> None:
    """A turn's key from the conversation up to its next state equals the key from the
    whole branch, unless the branch rewrote what the judge reads."""
    from scoring_workers.scorers import OpenClawJudgeScorer

    judge = OpenClawJudgeScorer(base_url="http://judge:30000")
    user, answer = {"role": "user", "content": "task"}, {"role": "assistant", "content": "step 1"}
    reply = {"role": "tool", "content": "ok"}
    first = Interaction(interaction_id="a", messages=[user], output_message_list=[answer])
    second_out = {"role": "assistant", "content": "step 2"}
    prefix = [user, answer, reply, second_out]  # the child's messages + output: up to the next state and past it
    branch = [*prefix, {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "bye"}]
    key = judge.stream_key(first, {"messages": prefix})
    assert key is not None and key[1].text == "ok"
    assert judge.stream_key(first, {"messages": branch}) == key
    rewritten = [user, answer, {"role": "tool", "content": "changed"}, *branch[3:]]
    assert judge.stream_key(first, {"messages": rewritten}) != key
