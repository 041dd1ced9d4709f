"""PRMRunner is a ScoringRunner: the protocol the worker, the fleet and score_member hold runners by."""

from __future__ import annotations

import inspect
from typing import Any

from scoring_workers.prm import PRMConfig, PRMRunner, ScoringRunner
from scoring_workers.prm.protocols import ScoringRunner as DefinedHere
from scoring_workers.scorers import LengthBudgetScorer

PROPERTIES = {"config", "scorers", "active", "streams"}
METHODS = {"scorer_infos"}
COROUTINES = {"run", "aclose", "score_turn"}


def _members(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_package_exports_the_protocol() -> None:
    assert ScoringRunner is DefinedHere


def test_the_protocol_names_exactly_these_members() -> None:
    assert _members(ScoringRunner) == PROPERTIES | METHODS | COROUTINES


async def test_a_runner_satisfies_the_protocol() -> None:
    runner: ScoringRunner = PRMRunner(PRMConfig(scorers=[LengthBudgetScorer()]))  # a typed assignment, too
    try:
        assert isinstance(runner, ScoringRunner)
    finally:
        await runner.aclose()


def test_each_member_has_the_protocols_kind() -> None:
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(PRMRunner, name), property), name
    for name in METHODS:
        assert callable(getattr(PRMRunner, name)) and not inspect.iscoroutinefunction(getattr(PRMRunner, name)), name
    for name in COROUTINES:
        assert inspect.iscoroutinefunction(getattr(PRMRunner, name)), name


def test_run_accepts_every_argument_the_protocol_passes() -> None:
    """Each parameter of the protocol's run is one of PRMRunner.run's, of the same kind and default."""
    mine = inspect.signature(PRMRunner.run).parameters
    for name, param in inspect.signature(ScoringRunner.run).parameters.items():
        assert name in mine, name
        assert mine[name].kind == param.kind, name
        assert mine[name].default == param.default, name


def test_something_without_aclose_is_not_a_runner() -> None:
    class Half:
        config: Any = None
        scorers: tuple[Any, ...] = ()
        active = False

        def scorer_infos(self) -> list[Any]:
            return []

        async def run(self, trajectory: Any, **kwargs: Any) -> Any:
            return None

    assert not isinstance(Half(), ScoringRunner)
