"""Scorer lifecycle (AReaL's Process Rewards, "Scorer Lifecycle"): create() with rollback, validation
hooks, aclose() ordering, concurrency, failures, cancellation and the sync constructor."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from infra.schema import Interaction, ModelResponse, ReadyTrajectory
from scoring_workers.prm import BaseScorer, PRMConfig, PRMRunner, PRMScorerConfig, RunnerClosedError
from tests.polling import eventually

EVENTS: list[tuple[str, ...]] = []
HOOKS: dict[str, Any] = {}  # per-test behaviour of the scorers below, keyed by label


class Tracked(BaseScorer):
    """Records construction, validation and closing in EVENTS; behaviour comes from HOOKS."""

    name = "tracked"

    def __init__(self, weight: float = 1.0, enabled: bool = True, label: str = "?") -> None:
        super().__init__(weight=weight, enabled=enabled)
        self.label = label
        if HOOKS.get(("init", label)):
            raise HOOKS[("init", label)]
        EVENTS.append(("init", label))

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return 1.0

    def validate_prm_config(self, config: PRMConfig, *, training_enabled: bool) -> Any:
        EVENTS.append(("validate", self.label, training_enabled))
        hook = HOOKS.get(("validate", self.label))
        if hook is None:
            return None
        if isinstance(hook, BaseException):
            raise hook
        return hook()  # a coroutine: async hook

    async def aclose(self) -> None:
        EVENTS.append(("close", self.label))
        hook = HOOKS.get(("close", self.label))
        if hook is not None:
            await hook()


# Distinct names so one runner can hold several (names must be unique).
class TrackedA(Tracked):
    name = "a"


class TrackedB(Tracked):
    name = "b"


class TrackedC(Tracked):
    name = "c"


@pytest.fixture(autouse=True)
def _reset() -> None:
    EVENTS.clear()
    HOOKS.clear()


def entry(cls: type[Tracked], label: str, *, enabled: bool = True) -> PRMScorerConfig:
    return PRMScorerConfig(f"{__name__}.{cls.__name__}", enabled=enabled, kwargs={"label": label})


def closes() -> list[str]:
    return [e[1] for e in EVENTS if e[0] == "close"]


def traj() -> ReadyTrajectory:
    return ReadyTrajectory(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=1,
        outcome_reward=0.0,
        interactions=[Interaction(interaction_id="a", model_response=ModelResponse.from_arrays([1], [2, 3]))],
    )


# ----------------------------------------------------------------------------- create()
async def test_create_owns_configs_and_mappings_and_borrows_instances() -> None:
    borrowed = TrackedB(label="borrowed")
    runner = await PRMRunner.create(
        PRMConfig(
            scorers=[
                entry(TrackedA, "from-config"),
                borrowed,
                {"path": f"{__name__}.TrackedC", "weight": 0.25, "enabled": False, "kwargs": {"label": "from-mapping"}},
            ]
        )
    )
    a, b, c = runner.scorers
    assert b is borrowed and (c.weight, c.enabled, c.label) == (0.25, False, "from-mapping")
    await runner.aclose()
    assert closes() == ["from-mapping", "from-config"]  # owned only, reverse creation order


async def test_create_empty_path_and_non_scorer_class() -> None:
    with pytest.raises(ValueError):
        await PRMRunner.create(PRMConfig(scorers=[PRMScorerConfig("")]))
    with pytest.raises(ValueError):
        await PRMRunner.create(PRMConfig(scorers=[{"path": ""}]))
    with pytest.raises(TypeError, match="not a subclass"):
        await PRMRunner.create(PRMConfig(scorers=[PRMScorerConfig("collections.OrderedDict")]))
    with pytest.raises(TypeError):
        await PRMRunner.create(PRMConfig(scorers=[object()]))  # type: ignore[list-item]


async def test_create_builds_as_cls_weight_enabled_kwargs() -> None:
    runner = await PRMRunner.create(
        PRMConfig(scorers=[PRMScorerConfig(f"{__name__}.TrackedA", weight=0.5, enabled=False, kwargs={"label": "k"})])
    )
    (scorer,) = runner.scorers
    assert (type(scorer), scorer.weight, scorer.enabled, scorer.label) == (TrackedA, 0.5, False, "k")


async def test_validate_hook_called_for_every_scorer_sync_and_async() -> None:
    awaited: list[str] = []

    async def async_hook() -> None:
        await asyncio.sleep(0)
        awaited.append("b")

    HOOKS[("validate", "b")] = async_hook
    await PRMRunner.create(
        PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b"), entry(TrackedC, "c", enabled=False)])
    )
    validations = [e for e in EVENTS if e[0] == "validate"]
    assert validations == [("validate", "a", True), ("validate", "b", True), ("validate", "c", False)]
    assert awaited == ["b"]
    assert EVENTS.index(("init", "c")) < EVENTS.index(("validate", "a", True))  # all built, then validated


async def test_validate_hook_gets_false_when_prm_is_disabled() -> None:
    await PRMRunner.create(PRMConfig(enabled=False, scorers=[entry(TrackedA, "a")]))
    assert ("validate", "a", False) in EVENTS


async def test_rollback_on_failing_validator_reraises_the_original() -> None:
    original = RuntimeError("config refused by c")
    HOOKS[("validate", "c")] = original
    borrowed = TrackedB(label="borrowed")
    with pytest.raises(RuntimeError) as info:
        await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), borrowed, entry(TrackedC, "c")]))
    assert info.value is original
    assert closes() == ["c", "a"]  # owned ones, reverse order; the borrowed one is not closed


async def test_rollback_on_async_validator_failure() -> None:
    async def refuse() -> None:
        await asyncio.sleep(0)
        raise LookupError("async refusal")

    HOOKS[("validate", "a")] = refuse
    with pytest.raises(LookupError, match="async refusal"):
        await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b")]))
    assert closes() == ["b", "a"]


async def test_rollback_when_a_constructor_fails() -> None:
    original = ValueError("bad kwargs for c")
    HOOKS[("init", "c")] = original
    with pytest.raises(ValueError) as info:
        await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b"), entry(TrackedC, "c")]))
    assert info.value is original
    assert closes() == ["b", "a"]  # c never returned from its constructor: not closed


async def test_rollback_when_resolution_fails() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), PRMScorerConfig("no_such_pkg_q.Scorer")]))
    assert closes() == ["a"]
    assert any("scorers[1] (no_such_pkg_q.Scorer)" in note for note in info.value.__notes__)


async def test_rollback_cleanup_failures_become_notes(caplog: pytest.LogCaptureFixture) -> None:
    original = RuntimeError("refused")
    HOOKS[("validate", "b")] = original

    async def broken_close() -> None:
        raise OSError("disk gone")

    HOOKS[("close", "a")] = broken_close
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as info:
        await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b")]))
    assert info.value is original
    assert closes() == ["b", "a"]
    assert any("disk gone" in note and "a.aclose()" in note and "cleanup" in note for note in info.value.__notes__)
    assert "closing scorer 'a' failed" in caplog.text


async def test_cancellation_during_rollback_propagates() -> None:
    HOOKS[("validate", "b")] = RuntimeError("refused")
    entered = asyncio.Event()

    async def slow_close() -> None:
        entered.set()
        await asyncio.sleep(10)

    HOOKS[("close", "b")] = slow_close
    task = asyncio.create_task(PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b")])))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closes() == ["b"]


async def test_sync_constructor_works_without_rollback() -> None:
    runner = PRMRunner(PRMConfig(scorers=[entry(TrackedA, "a")]))
    assert [s.label for s in runner.scorers] == ["a"] and ("validate", "a", True) in EVENTS
    assert (await runner.run(traj())).branches[0].scorer_totals == {"a": 1.0}
    EVENTS.clear()
    HOOKS[("init", "b")] = ValueError("nope")
    with pytest.raises(ValueError, match="nope"):
        PRMRunner(PRMConfig(scorers=[entry(TrackedA, "a2"), entry(TrackedB, "b")]))
    assert closes() == []  # no rollback in the synchronous constructor


def test_sync_constructor_refuses_async_hooks() -> None:
    async def hook() -> None:
        return None

    HOOKS[("validate", "a")] = hook
    with pytest.raises(TypeError, match="PRMRunner.create"):
        PRMRunner(PRMConfig(scorers=[entry(TrackedA, "a")]))


# ----------------------------------------------------------------------------- aclose()
async def test_aclose_closes_owned_once_in_reverse_order_including_disabled() -> None:
    borrowed = TrackedC(label="borrowed")
    runner = await PRMRunner.create(
        PRMConfig(scorers=[entry(TrackedA, "a"), borrowed, entry(TrackedB, "b", enabled=False)])
    )
    await runner.aclose()
    await runner.aclose()
    assert closes() == ["b", "a"]


async def test_concurrent_aclose_shares_one_cleanup() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    async def blocked() -> None:
        entered.set()
        await gate.wait()

    HOOKS[("close", "a")] = blocked
    runner = await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b")]))
    first = asyncio.create_task(runner.aclose())
    second = asyncio.create_task(runner.aclose())
    await entered.wait()  # the first close is inside scorer a's hook
    await asyncio.sleep(0)  # one loop turn: the second close reaches its wait
    assert not first.done() and not second.done()  # the second waits for the first's cleanup
    gate.set()
    await asyncio.gather(first, second)
    assert closes() == ["b", "a"]


async def test_aclose_failures_are_collected_after_all_attempts(caplog: pytest.LogCaptureFixture) -> None:
    async def fail_a() -> None:
        raise OSError("a failed")

    async def fail_c() -> None:
        raise ValueError("c failed")

    HOOKS[("close", "a")] = fail_a
    HOOKS[("close", "c")] = fail_c
    runner = await PRMRunner.create(
        PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b"), entry(TrackedC, "c")])
    )
    with caplog.at_level(logging.ERROR), pytest.raises(ExceptionGroup) as info:
        await runner.aclose()
    assert closes() == ["c", "b", "a"]
    assert [str(e) for e in info.value.exceptions] == ["c failed", "a failed"]
    assert "PRM scorer cleanup failed" in str(info.value)  # the words AReaL's tests look for
    assert "scorer 'c' failed to close" in caplog.text and "scorer 'a' failed to close" in caplog.text
    await runner.aclose()  # a second call retries nothing and does not raise again
    assert closes() == ["c", "b", "a"]


async def test_concurrent_callers_see_the_same_failure() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    async def fail_later() -> None:
        entered.set()
        await gate.wait()
        raise OSError("late failure")

    HOOKS[("close", "a")] = fail_later
    runner = await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a")]))
    first = asyncio.create_task(runner.aclose())
    second = asyncio.create_task(runner.aclose())
    await entered.wait()
    await asyncio.sleep(0)  # one loop turn: the second caller joins the running cleanup
    gate.set()
    outcomes = await asyncio.gather(first, second, return_exceptions=True)
    assert all(isinstance(o, ExceptionGroup) for o in outcomes) and outcomes[0] is outcomes[1]
    assert closes() == ["a"]


async def test_cancellation_during_close_propagates_and_is_not_retried() -> None:
    entered = asyncio.Event()

    async def slow() -> None:
        entered.set()
        await asyncio.sleep(10)

    HOOKS[("close", "b")] = slow
    runner = await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b")]))
    closer = asyncio.create_task(runner.aclose())
    waiter_started = asyncio.Event()

    async def wait_too() -> None:
        waiter_started.set()
        await runner.aclose()

    waiter = asyncio.create_task(wait_too())
    await entered.wait()
    await waiter_started.wait()
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    with pytest.raises(asyncio.CancelledError):
        await waiter  # the shared cleanup was cancelled
    assert closes() == ["b"]
    await runner.aclose()  # does not retry b, and does not start anything new
    assert closes() == ["b"]


async def test_cancelling_a_waiter_does_not_cancel_the_cleanup() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    async def blocked() -> None:
        entered.set()
        await gate.wait()

    HOOKS[("close", "a")] = blocked
    runner = await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a"), entry(TrackedB, "b")]))
    closer = asyncio.create_task(runner.aclose())
    await entered.wait()  # the cleanup is running, blocked in scorer a's hook
    waiter = asyncio.create_task(runner.aclose())
    await asyncio.sleep(0)  # one loop turn: the waiter reaches its wait
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.set()
    await closer
    assert closes() == ["b", "a"]


async def test_run_refused_once_closing_started() -> None:
    gate = asyncio.Event()

    async def blocked() -> None:
        await gate.wait()

    HOOKS[("close", "a")] = blocked
    runner = await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a")]))
    assert (await runner.run(traj())).branches
    closer = asyncio.create_task(runner.aclose())
    await eventually(lambda: runner.closing, timeout_s=5, what="the close to start")
    with pytest.raises(RunnerClosedError):
        await runner.run(traj())  # while closing
    gate.set()
    await closer
    with pytest.raises(RunnerClosedError):
        await runner.run(traj())  # after closing
    assert runner.closing


async def test_async_context_manager_closes() -> None:
    async with await PRMRunner.create(PRMConfig(scorers=[entry(TrackedA, "a")])) as runner:
        await runner.run(traj())
    assert closes() == ["a"]
