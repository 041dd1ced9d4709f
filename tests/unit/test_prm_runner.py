"""PRMRunner.run semantics: results, rejection, trajectory scorers, observations,
commit discipline, read-only inputs, branches, turn results and metrics."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from infra.schema import Interaction, ModelResponse, ReadyTrajectory, ScorerInfo, TokenRewards, encode
from scoring_workers.prm import (
    BaseScorer,
    BaseTrajectoryScorer,
    PRMConfig,
    PRMMetricObservation,
    PRMRunner,
    PRMScorerConfig,
    PRMScorerResult,
    PRMTurnResult,
)
from scoring_workers.prm.errors import error_context, failure_code
from scoring_workers.scorers import LengthBudgetScorer


# ----------------------------------------------------------------------------- helpers
def turn(iid: str, parent: str | None = None, n: int = 4, *, backed: bool = True, logprobs: Any = None) -> Interaction:
    return Interaction(
        interaction_id=iid,
        parent_id=parent,
        messages=[{"role": "user", "content": f"q-{iid}", "parts": [{"type": "text", "text": iid}]}],
        output_message_list=[{"role": "assistant", "content": f"a-{iid}"}],
        model_response=ModelResponse.from_arrays(np.arange(3), np.arange(n), logprobs) if backed else None,
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


def scorer(name: str, fn: Callable[..., Any], *, base: type[BaseScorer] = BaseScorer, **attrs: Any) -> type[BaseScorer]:
    """A scorer class named ``name`` whose evaluate is ``fn(interaction, ctx)`` (sync or async)."""

    async def evaluate(self: BaseScorer, interaction: Any, ctx: dict[str, Any]) -> Any:
        result = fn(interaction, ctx)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    return type(f"Scorer_{name}", (base,), {"name": name, "evaluate": evaluate, **attrs})


def joint(name: str, fn: Callable[..., Any]) -> type[BaseTrajectoryScorer]:
    async def evaluate_trajectory(self: BaseScorer, interactions: Any, ctx: dict[str, Any]) -> Any:
        result = fn(interactions, ctx)
        if asyncio.iscoroutine(result):
            result = await result
        return result

    return type(f"Joint_{name}", (BaseTrajectoryScorer,), {"name": name, "evaluate_trajectory": evaluate_trajectory})


def runner_of(*scorers: BaseScorer, enabled: bool = True) -> PRMRunner:
    return PRMRunner(PRMConfig(enabled=enabled, scorers=list(scorers)))


def obs(
    metric: str,
    target: str,
    value: Any,
    *,
    scope: str = "turn",
    kind: str = "boolean",
    aggs: tuple[str, ...] | None = None,
) -> PRMMetricObservation:
    aggs = aggs or (("count", "rate") if kind == "boolean" else ("sum", "mean"))
    return PRMMetricObservation(
        metric_id=metric, scope=scope, target_id=target, value=value, value_type=kind, aggregations=aggs
    )


class Rejected:
    """What a failed run says: the exception as raised (AReaL's types), its reason code
    (:func:`failure_code`, as the worker records it) and its context."""

    def __init__(self, exc: BaseException) -> None:
        context = error_context(exc)
        self.exc = exc
        self.reason = failure_code(exc)
        self.scorer_name = context.scorer_name if context else None
        self.interaction_id = context.interaction_id if context else None
        self.leaf_id = context.leaf_id if context else None
        self.trajectory_id = context.trajectory_id if context else None
        self.cause = exc if context is not None and context.raised_by_scorer else None

    def __str__(self) -> str:
        return str(self.exc)


async def rejected(runner: PRMRunner, trajectory: Any, **kwargs: Any) -> Rejected:
    with pytest.raises(Exception) as info:
        await runner.run(trajectory, **kwargs)
    return Rejected(info.value)


# ----------------------------------------------------------------------------- results
async def test_scalar_broadcasts_over_output_tokens_and_is_weighted() -> None:
    runner = runner_of(scorer("s", lambda i, c: 0.25)(weight=2.0))
    (branch,) = (await runner.run(traj(turn("a", n=4)))).branches
    t = branch.token_rewards["a"]
    assert t.dtype == torch.float32 and t.shape == (4,) and t.tolist() == [0.5, 0.5, 0.5, 0.5]


async def test_dense_tensor_keeps_token_positions() -> None:
    runner = runner_of(scorer("d", lambda i, c: torch.tensor([0.0, 1.0, -2.0], dtype=torch.float64))(weight=0.5))
    (branch,) = (await runner.run(traj(turn("a", n=3)))).branches
    assert branch.token_rewards["a"].dtype == torch.float32
    assert branch.token_rewards["a"].tolist() == [0.0, 0.5, -1.0]


async def test_zero_dim_tensor_is_a_shape_error_as_in_areal() -> None:
    runner = runner_of(scorer("z", lambda i, c: torch.tensor(0.75))())
    error = await rejected(runner, traj(turn("a", n=2)))
    assert type(error.exc) is ValueError and "must return shape (2,)" in str(error)


@pytest.mark.parametrize("bad", [torch.zeros(2), torch.zeros(1), torch.zeros(1, 3), torch.zeros(4)])
async def test_tensor_shape_must_equal_output_len(bad: torch.Tensor) -> None:
    runner = runner_of(scorer("shape", lambda i, c: bad)())
    error = await rejected(runner, traj(turn("a", n=3)))
    assert type(error.exc) is ValueError and "must return shape (3,)" in str(error)
    assert error.reason == "invalid_reward" and error.interaction_id == "a"


async def test_output_len_zero_is_an_error() -> None:
    runner = runner_of(scorer("s", lambda i, c: 1.0)())
    error = await rejected(runner, traj(turn("a", n=0)))
    assert error.reason == "invalid_reward" and "output_len is 0" in str(error)


@pytest.mark.parametrize(
    "raw", [float("nan"), float("inf"), torch.tensor([0.0, float("nan")]), np.array([1.0, -np.inf])]
)
async def test_non_finite_raw_reward_is_an_error(raw: Any) -> None:
    runner = runner_of(scorer("s", lambda i, c: raw)())
    error = await rejected(runner, traj(turn("a", n=2)))
    assert error.reason == "invalid_reward" and "finite" in str(error)


@pytest.mark.parametrize("raw", [3e38, torch.tensor([3e38, 0.0])])
async def test_non_finite_weighted_reward_is_an_error(raw: Any) -> None:
    runner = runner_of(scorer("s", lambda i, c: raw)(weight=10.0))
    error = await rejected(runner, traj(turn("a", n=2)))
    assert error.reason == "invalid_reward" and "weighted" in str(error)


async def test_non_numeric_reward_is_an_error() -> None:
    runner = runner_of(scorer("s", lambda i, c: "1.0")())
    assert (await rejected(runner, traj(turn("a")))).reason == "invalid_reward"


async def test_weighted_contributions_of_scorers_add_up() -> None:
    a = scorer("a", lambda i, c: 1.0)(weight=0.5)
    b = scorer("b", lambda i, c: torch.tensor([1.0, 2.0, 3.0]))(weight=2.0)
    c = scorer("c", lambda i, c: -0.5)(weight=1.0)
    (branch,) = (await runner_of(a, b, c).run(traj(turn("x", n=3)))).branches
    assert branch.token_rewards["x"].tolist() == [2.0, 4.0, 6.0]
    assert branch.scorer_totals == {"a": 0.5, "b": 4.0, "c": -0.5}


async def test_result_does_not_alias_the_scorers_tensor() -> None:
    kept: list[torch.Tensor] = []

    def fn(i: Any, c: Any) -> torch.Tensor:
        kept.append(torch.ones(2))
        return kept[-1]

    (branch,) = (await runner_of(scorer("s", fn)()).run(traj(turn("a", n=2)))).branches
    kept[0].fill_(99.0)  # the scorer edits its tensor after returning it
    assert branch.token_rewards["a"].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- None / exceptions
async def test_first_exception_in_turn_order_wins() -> None:
    class Boom(Exception):
        pass

    async def fn(i: Any, c: Any) -> float:
        if i.interaction_id == "a":
            await asyncio.sleep(0.05)  # finishes last
            raise Boom("turn a")
        if i.interaction_id == "c":
            await asyncio.sleep(0)  # finishes first
            raise Boom("turn c")
        return 1.0

    runner = runner_of(scorer("boom", fn)())
    error = await rejected(runner, traj(turn("a"), turn("b", "a"), turn("c", "b")))
    assert error.reason == "scorer_error" and error.scorer_name == "boom" and error.interaction_id == "a"
    assert type(error.exc) is Boom and str(error.exc) == "turn a"  # the original object, unwrapped
    assert any("scorer 'boom'" in note and "interaction 'a'" in note for note in error.exc.__notes__)
    assert error.trajectory_id == "traj-1" and error.leaf_id == "c"


async def test_none_turns_are_counted_in_the_error() -> None:
    runner = runner_of(scorer("maybe", lambda i, c: None if i.interaction_id in ("a", "c") else 0.0)())
    error = await rejected(runner, traj(turn("a"), turn("b", "a"), turn("c", "b")))
    assert error.reason == "scorer_returned_none" and type(error.exc) is RuntimeError
    assert "returned None" in str(error) and "2/3" in str(error) and error.cause is None


async def test_exception_wins_over_none() -> None:
    def fn(i: Any, c: Any) -> Any:
        if i.interaction_id == "a":
            return None
        raise RuntimeError("later turn failed")

    error = await rejected(runner_of(scorer("mix", fn)()), traj(turn("a"), turn("b", "a")))
    assert error.reason == "scorer_error" and isinstance(error.cause, RuntimeError)


async def test_deliberate_zero_is_a_score() -> None:
    scored = await runner_of(scorer("zero", lambda i, c: 0.0)()).run(traj(turn("a", n=2)))
    (branch,) = scored.branches
    assert branch.token_rewards["a"].tolist() == [0.0, 0.0]
    assert branch.turn_results == [PRMTurnResult(interaction_id="a", scorer_name="zero", reward=0.0)]


async def test_synchronous_failure_stops_before_later_turns() -> None:
    seen: list[str] = []

    def fn(i: Any, c: Any) -> float:
        seen.append(i.interaction_id)
        if i.interaction_id == "b":
            raise ValueError("bad")
        return 1.0

    error = await rejected(runner_of(scorer("s", fn)()), traj(turn("a"), turn("b", "a"), turn("c", "b")))
    assert error.interaction_id == "b" and seen == ["a", "b"]


async def test_suspending_turns_run_concurrently() -> None:
    in_flight = 0
    peak = 0
    all_in = asyncio.Event()

    async def fn(i: Any, c: Any) -> float:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == 3:
            all_in.set()
        async with asyncio.timeout(2):  # timeouts inside scorers work on every path
            await all_in.wait()
        in_flight -= 1
        return 1.0

    scored = await runner_of(scorer("judge", fn)()).run(traj(turn("a"), turn("b", "a"), turn("c", "b")))
    assert peak == 3 and scored.branches[0].scorer_totals == {"judge": 3.0}


async def test_timeout_inside_scorer_is_a_scorer_error() -> None:
    async def fn(i: Any, c: Any) -> float:
        async with asyncio.timeout(0.01):
            await asyncio.sleep(1)
        return 1.0

    error = await rejected(runner_of(scorer("slow", fn)()), traj(turn("a"), turn("b", "a")))
    assert error.reason == "scorer_error" and isinstance(error.cause, TimeoutError) and error.interaction_id == "a"


async def test_cancelling_run_cancels_every_turn() -> None:
    cancelled: list[str] = []
    entered: list[str] = []
    started = asyncio.Event()  # every turn is inside the scorer

    async def fn(i: Any, c: Any) -> float:
        try:
            entered.append(i.interaction_id)
            if len(entered) == 3:
                started.set()
            await asyncio.Event().wait()  # hangs until cancelled
        except asyncio.CancelledError:
            cancelled.append(i.interaction_id)
            raise
        return 1.0

    runner = runner_of(scorer("hang", fn)())
    task = asyncio.create_task(runner.run(traj(turn("a"), turn("b", "a"), turn("c", "b"))))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == ["a", "b", "c"]


# ----------------------------------------------------------------------------- trajectory scorers
async def test_trajectory_scorer_gets_parent_before_child_regardless_of_input_order() -> None:
    seen: list[list[str]] = []

    def fn(interactions: Any, ctx: Any) -> dict[str, float]:
        seen.append([i.interaction_id for i in interactions])
        return {}

    runner = runner_of(joint("order", fn)())
    await runner.run(traj(turn("c", "b"), turn("b", "a"), turn("a")))  # child first on the wire
    assert seen == [["a", "b", "c"]]


async def test_trajectory_scorer_called_once_per_branch() -> None:
    seen: list[list[str]] = []

    def fn(interactions: Any, ctx: Any) -> dict[str, float]:
        seen.append([i.interaction_id for i in interactions])
        return {interactions[-1].interaction_id: 1.0}

    scored = await runner_of(joint("leafy", fn)()).run(traj(turn("r"), turn("x", "r"), turn("y", "r")))
    assert seen == [["r", "x"], ["r", "y"]]
    assert [b.scorer_totals for b in scored.branches] == [{"leafy": 1.0}, {"leafy": 1.0}]


async def test_trajectory_scorer_missing_ids_score_zero() -> None:
    runner = runner_of(joint("j", lambda xs, c: {"b": 2.0})(weight=0.5))
    (branch,) = (await runner.run(traj(turn("a", n=2), turn("b", "a", n=2)))).branches
    assert branch.token_rewards["a"].tolist() == [0.0, 0.0] and branch.token_rewards["b"].tolist() == [1.0, 1.0]
    assert [(r.interaction_id, r.reward) for r in branch.turn_results] == [("a", 0.0), ("b", 1.0)]


@pytest.mark.parametrize(
    ("answer", "reason", "fragment", "kind"),
    [
        ({"zzz": 1.0, "b": 0.0, "yyy": 2.0}, "invalid_reward", "unknown interaction ids ['yyy', 'zzz']", ValueError),
        ({None: 1.0}, "invalid_reward", "None interaction id", ValueError),
        ([("a", 1.0)], "invalid_reward", "must return a mapping", TypeError),  # AReaL: Mapping only
        ({"a": None}, "scorer_returned_none", "returned None for 1/2", RuntimeError),
        (None, "scorer_returned_none", "returned None for 2/2", RuntimeError),
        (42, "invalid_reward", "must return a mapping", TypeError),
    ],
)
async def test_trajectory_scorer_bad_answers(answer: Any, reason: str, fragment: str, kind: type) -> None:
    error = await rejected(runner_of(joint("j", lambda xs, c: answer)()), traj(turn("a"), turn("b", "a")))
    assert error.reason == reason and fragment in str(error) and error.scorer_name == "j"
    assert type(error.exc) is kind


async def test_trajectory_scorer_values_go_through_prepare_result() -> None:
    class Obs(BaseTrajectoryScorer):
        name = "obs"

        async def evaluate_trajectory(self, interactions: Any, ctx: Any) -> dict[str, float]:
            return {"a": 1.0}

        def prepare_result(self, interaction: Any, result: Any, ctx: Any) -> PRMScorerResult:
            return PRMScorerResult(result, (obs("seen", interaction.interaction_id, True),))

    (branch,) = (await runner_of(Obs()).run(traj(turn("a"), turn("b", "a")))).branches
    assert [len(r.observations) for r in branch.turn_results] == [1, 0]  # missing id: plain 0


async def test_cycle_is_an_error_before_any_scorer_runs() -> None:
    calls: list[Any] = []
    runner = runner_of(joint("j", lambda xs, c: calls.append(xs) or {})())
    looped = SimpleNamespace(
        trajectory_id="t",
        session_id="s",
        is_eval=False,
        interactions=[turn("root"), turn("a", "b"), turn("b", "a")],  # a <-> b never reach a root
    )
    error = await rejected(runner, looped)
    assert error.reason == "invalid_trajectory" and "cycle" in str(error) and calls == []


# ----------------------------------------------------------------------------- observations
async def test_turn_observation_must_target_its_own_turn() -> None:
    class Wrong(BaseScorer):
        name = "wrong"

        async def evaluate_result(self, interaction: Any, ctx: Any) -> PRMScorerResult:
            return PRMScorerResult(1.0, (obs("m", "someone-else", True),))

    error = await rejected(runner_of(Wrong()), traj(turn("a")))
    assert error.reason == "invalid_observation" and "expected 'a'" in str(error) and type(error.exc) is ValueError


async def test_duplicate_observation_within_a_run_is_an_error() -> None:
    class Twice(BaseScorer):
        name = "twice"

        async def evaluate_result(self, interaction: Any, ctx: Any) -> PRMScorerResult:
            return PRMScorerResult(1.0, (obs("len", ctx["leaf_id"], 1.0, scope="trajectory", kind="float"),))

    error = await rejected(runner_of(Twice()), traj(turn("a"), turn("b", "a")))  # both turns observe the leaf
    assert error.reason == "invalid_observation" and "duplicate structured metric 'len'" in str(error)


async def test_metric_schema_is_stable_per_scorer_across_runs() -> None:
    kind = {"value": "boolean"}

    class Flip(BaseScorer):
        name = "flip"

        async def evaluate_result(self, interaction: Any, ctx: Any) -> PRMScorerResult:
            value = True if kind["value"] == "boolean" else 1.5
            return PRMScorerResult(1.0, (obs("m", interaction.interaction_id, value, kind=kind["value"]),))

    other = scorer("other", lambda i, c: PRMScorerResult(0.0, (obs("m", i.interaction_id, 2.0, kind="float"),)))()
    runner = runner_of(Flip(), other)  # `other` uses metric "m" as float: schemas are per scorer
    await runner.run(traj(turn("a")))
    kind["value"] = "float"
    error = await rejected(runner, traj(turn("a")))
    assert error.reason == "invalid_observation" and "schema changed across runs" in str(error)
    assert error.scorer_name == "flip"


async def test_aggregation_order_is_part_of_the_schema_as_in_areal() -> None:
    order = {"aggs": ("count", "rate")}
    s = scorer("o", lambda i, c: PRMScorerResult(1.0, (obs("m", i.interaction_id, True, aggs=order["aggs"]),)))()
    runner = runner_of(s)
    await runner.run(traj(turn("a")))
    order["aggs"] = ("rate", "count")
    error = await rejected(runner, traj(turn("a")))
    assert error.reason == "invalid_observation" and "schema changed across runs" in str(error)


async def test_failed_run_binds_no_schema_and_commits_nothing() -> None:
    mode = {"kind": "boolean", "fail_b": True}

    class Partial(BaseScorer):
        name = "partial"

        async def evaluate_result(self, interaction: Any, ctx: Any) -> PRMScorerResult:
            value = True if mode["kind"] == "boolean" else 0.5
            reward = float("nan") if (interaction.interaction_id == "b" and mode["fail_b"]) else 1.0
            return PRMScorerResult(reward, (obs("m", interaction.interaction_id, value, kind=mode["kind"]),))

    runner = runner_of(Partial())
    trajectory = traj(turn("a"), turn("b", "a"))
    assert (await rejected(runner, trajectory)).reason == "invalid_reward"  # turn a was valid, b not
    mode.update(kind="float", fail_b=False)
    scored = await runner.run(trajectory)  # float is fine: the failed boolean run bound nothing
    assert scored.stats()["rollout/prm_metric/turn/partial/m/sum"] == 1.0
    mode["kind"] = "boolean"
    assert (await rejected(runner, trajectory)).reason == "invalid_observation"


async def test_schema_of_a_run_rejected_by_a_later_scorer_is_not_bound() -> None:
    mode = {"kind": "boolean", "fail": True}
    first = scorer(
        "first",
        lambda i, c: PRMScorerResult(
            1.0, (obs("m", i.interaction_id, True if mode["kind"] == "boolean" else 1.0, kind=mode["kind"]),)
        ),
    )()
    second = scorer("second", lambda i, c: None if mode["fail"] else 0.0)()
    runner = runner_of(first, second)
    assert (await rejected(runner, traj(turn("a")))).reason == "scorer_returned_none"
    mode.update(kind="float", fail=False)
    await runner.run(traj(turn("a")))


# ----------------------------------------------------------------------------- commit discipline
async def test_scorers_run_in_config_order() -> None:
    order: list[str] = []
    scorers = [scorer(n, lambda i, c, n=n: order.append(n) or 0.0)() for n in ("zeta", "alpha", "mid")]
    scored = await runner_of(*scorers).run(traj(turn("a")))
    assert order == ["zeta", "alpha", "mid"]
    assert [r.scorer_name for r in scored.branches[0].turn_results] == ["zeta", "alpha", "mid"]
    assert list(scored.branches[0].scorer_totals) == ["zeta", "alpha", "mid"]


class Counting(BaseScorer):
    name = "counting"
    built = 0
    calls = 0

    def __init__(self, weight: float = 1.0, enabled: bool = True) -> None:
        super().__init__(weight=weight, enabled=enabled)
        type(self).built += 1

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        type(self).calls += 1
        return 1.0


async def test_disabled_scorers_are_constructed_but_skipped() -> None:
    Counting.built = Counting.calls = 0
    runner = PRMRunner(
        PRMConfig(
            scorers=[
                PRMScorerConfig(f"{__name__}.Counting", enabled=False),
                PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer"),
            ]
        )
    )
    assert Counting.built == 1 and runner.scorers[0].enabled is False
    scored = await runner.run(traj(turn("a")))
    assert Counting.calls == 0
    assert {r.scorer_name for r in scored.turn_results} == {"length_budget"}
    assert runner.scorer_infos() == [ScorerInfo("length_budget", "1")]


async def test_prm_disabled_runs_nothing_and_gives_zeros() -> None:
    Counting.calls = 0
    runner = runner_of(Counting(), enabled=False)
    scored = await runner.run(traj(turn("a", n=3)))
    assert Counting.calls == 0 and runner.scorer_infos() == [] and not runner.active
    assert scored.branches[0].token_rewards["a"].tolist() == [0.0, 0.0, 0.0]
    assert scored.branches[0].scorer_totals == {} and scored.stats() == {}


async def test_scorer_infos_names_and_versions_in_config_order() -> None:
    v2 = scorer("second", lambda i, c: 0.0, version="2.1")()
    runner = runner_of(LengthBudgetScorer(), v2, scorer("off", lambda i, c: 0.0)(enabled=False))
    assert runner.scorer_infos() == [ScorerInfo("length_budget", "1"), ScorerInfo("second", "2.1")]


def test_duplicate_scorer_names_are_allowed() -> None:
    runner = runner_of(LengthBudgetScorer(), LengthBudgetScorer(max_output_tokens=5, enabled=False))
    assert [s.name for s in runner.scorers] == ["length_budget", "length_budget"]


# ----------------------------------------------------------------------------- inputs
async def test_token_backing_is_checked_before_any_scorer_runs() -> None:
    Counting.calls = 0
    runner = runner_of(Counting())
    error = await rejected(runner, traj(turn("a"), turn("b", "a"), turn("c", "b", backed=False)))
    assert error.reason == "not_token_backed" and error.interaction_id == "c" and Counting.calls == 0


async def test_ctx_is_a_per_call_copy_with_is_eval() -> None:
    seen: list[dict[str, Any]] = []

    def fn(i: Any, ctx: dict[str, Any]) -> float:
        seen.append(dict(ctx))
        ctx["scratch"] = i.interaction_id  # must not leak to the next call
        return 0.0

    caller_ctx = {"task": "swe", "is_eval": "caller's"}
    runner = runner_of(scorer("c", fn)())
    await runner.run(traj(turn("a"), turn("b", "a")), ctx=caller_ctx, is_eval=True)
    assert caller_ctx == {"task": "swe", "is_eval": "caller's"}
    assert [c["is_eval"] for c in seen] == [True, True] and all(c["task"] == "swe" for c in seen)
    assert "scratch" not in seen[1]
    assert (seen[0]["trajectory_id"], seen[0]["session_id"], seen[0]["leaf_id"]) == ("traj-1", "sess-1", "b")
    seen.clear()
    await runner.run(traj(turn("a"), is_eval=True))  # default: the trajectory's own flag
    assert seen[0]["is_eval"] is True


async def test_ctx_messages_is_the_branch_conversation_and_read_only() -> None:
    attempts: list[str] = []

    def fn(i: Any, ctx: dict[str, Any]) -> float:
        messages = ctx["messages"]
        for attempt in (
            lambda: messages.append({}),
            lambda: messages[0].__setitem__("content", "hacked"),
            lambda: messages[0]["parts"][0].update(text="hacked"),
            lambda: messages[0]["parts"].append({}),
            lambda: i.messages[0].pop("role"),
            lambda: setattr(i, "reward", 5.0),
        ):
            try:
                attempt()
            except (TypeError, AttributeError):
                attempts.append("refused")
        return float(len(messages))

    trajectory = traj(turn("a"), turn("b", "a"))
    before = encode(trajectory)
    (branch,) = (await runner_of(scorer("ro", fn)()).run(trajectory)).branches
    assert attempts == ["refused"] * 12
    assert encode(trajectory) == before
    # leaf "b": its input messages then its outputs
    assert branch.scorer_totals == {"ro": 4.0}


async def test_views_expose_areal_attribute_names() -> None:
    seen: dict[str, Any] = {}

    def fn(i: Any, ctx: Any) -> float:
        seen[i.interaction_id] = i
        return 0.0

    await runner_of(scorer("v", fn)()).run(traj(turn("a", n=2, logprobs=[-0.5, -1.5]), turn("b", "a", n=3)))
    a, b = seen["a"], seen["b"]
    assert b.parent is a and a.parent is None and b.parent_id == "a" and a.reward is None
    assert b.messages[0]["content"] == "q-b" and b.output_message_list[0]["content"] == "a-b"
    assert a.model_response.output_len == 2 and a.model_response.output_tokens.tolist() == [0, 1]
    assert a.model_response.output_logprobs.tolist() == [-0.5, -1.5]
    with pytest.raises(ValueError):
        a.model_response.output_tokens[0] = 7  # read-only numpy view


# ----------------------------------------------------------------------------- branches
async def test_two_branches_sharing_a_root_score_independently() -> None:
    views: dict[str, list[Any]] = {}

    def fn(i: Any, ctx: dict[str, Any]) -> float:
        views.setdefault(i.interaction_id, []).append(i)
        return 1.0 if ctx["leaf_id"] == "left" else 0.25  # branch-dependent score of the same root

    trajectory = traj(turn("root", n=2), turn("left", "root", n=3), turn("right", "root", n=1))
    before = encode(trajectory)
    scored = await runner_of(scorer("b", fn)(weight=2.0)).run(trajectory)
    left, right = scored.branches
    assert (left.leaf_id, left.path, right.leaf_id, right.path) == (
        "left",
        ["root", "left"],
        "right",
        ["root", "right"],
    )
    assert left.token_rewards["root"].tolist() == [2.0, 2.0] and right.token_rewards["root"].tolist() == [0.5, 0.5]
    assert left.scorer_totals == {"b": 4.0} and right.scorer_totals == {"b": 1.0}
    assert views["root"][0] is not views["root"][1]  # one clone per branch
    assert views["left"][0].parent is views["root"][0] and views["right"][0].parent is views["root"][1]
    assert encode(trajectory) == before


async def test_no_partial_results_when_one_branch_fails() -> None:
    def fn(i: Any, ctx: dict[str, Any]) -> Any:
        return None if i.interaction_id == "right" else 1.0

    trajectory = traj(turn("root"), turn("left", "root"), turn("right", "root"))
    error = await rejected(runner_of(scorer("b", fn)()), trajectory)
    assert error.leaf_id == "right" and error.reason == "scorer_returned_none"


async def test_turns_no_scorer_touched_get_zeros() -> None:
    runner = runner_of(scorer("off", lambda i, c: 1.0)(enabled=False))
    (branch,) = (await runner.run(traj(turn("a", n=2), turn("b", "a", n=3)))).branches
    assert branch.token_rewards["a"].tolist() == [0.0, 0.0] and branch.token_rewards["b"].tolist() == [0.0] * 3
    assert branch.turn_results == [] and branch.scorer_totals == {}


# ----------------------------------------------------------------------------- turn results
async def test_turn_result_reward_is_mean_of_weighted_tokens_and_totals_sum() -> None:
    dense = scorer("dense", lambda i, c: torch.tensor([0.0, 1.0, 2.0, 3.0]) if i.interaction_id == "a" else 1.0)(
        weight=0.5
    )
    (branch,) = (await runner_of(dense).run(traj(turn("a", n=4), turn("b", "a", n=4)))).branches
    assert [(r.interaction_id, r.scorer_name, r.reward) for r in branch.turn_results] == [
        ("a", "dense", 0.75),
        ("b", "dense", 0.5),
    ]
    assert branch.scorer_totals == {"dense": 1.25}


async def test_to_branch_results_stores_uniform_turns_compactly() -> None:
    s = scorer("m", lambda i, c: 1.0 if i.interaction_id == "a" else torch.tensor([0.0, 1.0]))(weight=0.5)
    scored = await runner_of(s).run(traj(turn("a", n=3), turn("b", "a", n=2)))
    (result,) = scored.to_branch_results()
    assert result.leaf_id == "b" and result.path == ["a", "b"] and result.scorer_totals == {"m": 0.75}
    assert result.token_rewards["a"] == TokenRewards(length=3, uniform=0.5)
    assert result.token_rewards["b"].uniform is None and result.token_rewards["b"].to_numpy().tolist() == [0.0, 0.5]
    msgspec.msgpack.encode(result)  # wire-ready


# ----------------------------------------------------------------------------- metrics
async def test_stats_names_values_and_counts() -> None:
    class Mixed(BaseScorer):
        name = "my scorer/v2"

        async def evaluate_result(self, interaction: Any, ctx: dict[str, Any]) -> PRMScorerResult:
            n = interaction.model_response.output_len
            observations = [
                obs("ok:a-b_c.d", interaction.interaction_id, n <= 2),
                obs("tokens", interaction.interaction_id, float(n), kind="float"),
            ]
            if interaction.interaction_id == ctx["leaf_id"]:
                observations.append(obs("depth", ctx["leaf_id"], 2.0, scope="trajectory", kind="float", aggs=("mean",)))
            return PRMScorerResult(float(n), observations)

    trajectory = traj(turn("r", n=1), turn("x", "r", n=2), turn("y", "r", n=5))
    stats = (await runner_of(Mixed(weight=0.5)).run(trajectory)).stats()
    ns, name = "rollout", "my%20scorer%2Fv2"
    # branches (r, x) and (r, y); turn rewards are weighted: r 0.5 (twice), x 1.0, y 2.5
    assert stats[f"{ns}/prm_turn_reward/{name}"] == pytest.approx((0.5 + 1.0 + 0.5 + 2.5) / 4)
    assert stats[f"{ns}/prm_turn_reward/{name}__count"] == 4.0
    assert stats[f"{ns}/prm_trajectory_reward/{name}"] == pytest.approx((1.5 + 3.0) / 2)
    assert stats[f"{ns}/prm_trajectory_reward/{name}__count"] == 2.0
    ok = f"{ns}/prm_metric/turn/{name}/ok:a-b_c.d"
    assert stats[f"{ok}/count"] == 3.0  # number of true observations (r, x, r)
    assert stats[f"{ok}/rate"] == 0.75 and stats[f"{ok}/rate__count"] == 4.0
    assert stats[f"{ok}/observed_count"] == 4.0
    tokens = f"{ns}/prm_metric/turn/{name}/tokens"
    assert stats[f"{tokens}/sum"] == 9.0 and stats[f"{tokens}/mean"] == 2.25  # unweighted
    assert stats[f"{tokens}/mean__count"] == 4.0 and stats[f"{tokens}/observed_count"] == 4.0
    depth = f"{ns}/prm_metric/trajectory/{name}/depth"
    assert stats[f"{depth}/mean"] == 2.0 and stats[f"{depth}/mean__count"] == 2.0
    assert f"{ok}/count__count" not in stats and f"{tokens}/sum__count" not in stats  # plain counts/sums
    assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values())


async def test_zero_weight_still_records_observations() -> None:
    runner = runner_of(LengthBudgetScorer(weight=0.0, max_output_tokens=2))
    scored = await runner.run(traj(turn("a", n=2), turn("b", "a", n=3)))
    stats = scored.stats()
    assert stats["rollout/prm_turn_reward/length_budget"] == 0.0
    assert stats["rollout/prm_metric/turn/length_budget/within_budget/count"] == 1.0
    assert stats["rollout/prm_metric/turn/length_budget/within_budget/rate"] == 0.5
    assert scored.branches[0].token_rewards["a"].tolist() == [0.0, 0.0]


async def test_eval_namespace() -> None:
    runner = runner_of(LengthBudgetScorer())
    evaluated = await runner.run(traj(turn("a"), is_eval=True))
    assert set(evaluated.stats()) == {
        k.replace("rollout/", "eval-rollout/", 1) for k in (await runner.run(traj(turn("a")))).stats()
    }
    assert all(k.startswith("eval-rollout/") for k in evaluated.stats())
    assert all(k.startswith("rollout/") for k in evaluated.stats(namespace="rollout"))
    forced = await runner.run(traj(turn("a")), is_eval=True)
    assert all(k.startswith("eval-rollout/") for k in forced.stats())


async def test_sync_evaluate_result_is_a_scorer_error() -> None:
    class NotAsync(BaseScorer):
        name = "not_async"

        def evaluate_result(self, interaction: Any, ctx: Any) -> Any:  # type: ignore[override]
            return PRMScorerResult(1.0)

    error = await rejected(runner_of(NotAsync()), traj(turn("a")))
    assert error.reason == "scorer_error" and isinstance(error.cause, TypeError)
    assert "must be async" in str(error.cause)


async def test_summed_rewards_must_stay_finite_in_float32() -> None:
    big = [scorer(n, lambda i, c: 3e38)() for n in ("x", "y")]  # each finite, the sum is not
    error = await rejected(runner_of(*big), traj(turn("a")))
    assert error.reason == "invalid_reward" and "summed" in str(error)


async def test_stats_merge_across_workers_with_shaper_merge_stats() -> None:
    merge_stats = pytest.importorskip("shaper.metrics").merge_stats
    runner = runner_of(LengthBudgetScorer(max_output_tokens=2))
    one = (await runner.run(traj(turn("a", n=1)))).stats()  # 1 of 1 within budget
    three = (await runner.run(traj(turn("a", n=1), turn("b", "a", n=5), turn("c", "b", n=9)))).stats()  # 1 of 3
    merged = merge_stats([one, three])
    key = "rollout/prm_metric/turn/length_budget/within_budget"
    assert merged[f"{key}/rate"] == 0.5 and merged[f"{key}/rate__count"] == 4.0  # (1*1 + 1/3*3) / 4
    assert merged[f"{key}/count"] == 2.0 and merged[f"{key}/observed_count"] == 4.0
    assert merged["rollout/prm_trajectory_reward/length_budget"] == 1.0  # (1 + 1) / 2 branches
    assert merged["rollout/prm_turn_reward/length_budget__count"] == 4.0


def test_contributions_are_shape_checked_when_added() -> None:
    from scoring_workers.prm.runner import _accumulate

    acc = _accumulate(0.5, torch.tensor([1.0, 2.0]))  # scalar so far + dense
    assert acc.tolist() == [1.5, 2.5]
    assert _accumulate(acc, 1.0).tolist() == [2.5, 3.5]
    with pytest.raises(RuntimeError, match="shape"):
        _accumulate(acc, torch.zeros(3))


# ----------------------------------------------------------------------------- scorer-declared reasons
class _DeclaredFailure(RuntimeError):
    def __init__(self, reason: object) -> None:
        super().__init__("the judge could not decide")
        self.reason = reason


@pytest.mark.parametrize(
    ("declared", "recorded"),
    [
        ("judge_failed", "judge_failed"),  # a well-formed code is kept
        ("Not A Code!", "scorer_error"),  # anything else falls back
        (42, "scorer_error"),
    ],
)
async def test_a_scorer_may_name_its_rejection_reason(declared: object, recorded: str) -> None:
    def fail(interaction: Any, ctx: Any) -> float:
        raise _DeclaredFailure(declared)

    runner = PRMRunner(PRMConfig(scorers=[scorer("judge", fail)()]))
    with pytest.raises(_DeclaredFailure) as info:  # the scorer's own exception, unwrapped
        await runner.run(traj(turn("a")))
    assert failure_code(info.value) == recorded
