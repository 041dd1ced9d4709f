"""One exception root: every public exception class of the packages derives from
:class:`PRMPipelineError`, keeps its standard base, and sits in a typed subtree."""

from __future__ import annotations

import ast
import importlib
import pickle
import pkgutil
from pathlib import Path

import pytest

import prm_pipeline
from infra import errors
from infra.errors import PRMPipelineError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("infra", "scoring_workers", "shaper", "producers", "prm_pipeline")
SUBTREES = {errors.ConfigurationError, errors.WireError, errors.ServiceError, errors.ScoringError, errors.TrainingError}


def _modules() -> tuple[list[object], list[str]]:
    """Imported modules, and the names of those whose optional dependency is absent."""
    imported, absent = [], []
    for pkg in PACKAGES:
        root = importlib.import_module(pkg)
        imported.append(root)
        for info in pkgutil.walk_packages(root.__path__, f"{pkg}."):
            try:
                imported.append(importlib.import_module(info.name))
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.split(".")[0] in PACKAGES:
                    raise
                absent.append(info.name)  # e.g. shaper.integrations.verl without verl: checked by its source
    return imported, absent


def _public_exceptions() -> list[type[BaseException]]:
    modules, _ = _modules()
    found = {
        obj
        for m in modules
        for obj in vars(m).values()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == m.__name__
        and not obj.__name__.startswith("_")
    }
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def test_every_public_exception_derives_from_the_root() -> None:
    found = _public_exceptions()
    assert len(found) >= 20, [c.__name__ for c in found]
    outside = [f"{c.__module__}.{c.__name__}" for c in found if not issubclass(c, PRMPipelineError)]
    assert outside == []
    untyped = [
        c.__name__
        for c in found
        if c not in SUBTREES | {PRMPipelineError}
        and not any(issubclass(c, s) for s in SUBTREES)
        and c.__name__ != "AuditError"
    ]
    assert untyped == [], "put each exception in a subtree of infra.errors"


def test_modules_without_their_optional_dependency_declare_the_root_too() -> None:
    """A module that cannot be imported here (verl absent) is checked from its source."""
    _, absent = _modules()
    names = {"PRMPipelineError", *(s.__name__ for s in SUBTREES)}
    for name in absent:
        tree = ast.parse((ROOT / (name.replace(".", "/") + ".py")).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & {"Exception", "ValueError", "RuntimeError", "TimeoutError", "ConnectionError", "OSError"}:
                    assert bases & names, f"{name}.{node.name} does not derive from PRMPipelineError"


@pytest.mark.parametrize(
    ("cls", "standard"),
    [
        ("infra.config.ConfigError", ValueError),
        ("infra.schema.InvalidMessage", ValueError),
        ("infra.startup.KafkaUnreachable", ConnectionError),
        ("infra.kafka.KafkaAuthError", RuntimeError),
        ("shaper.batch.ConcatExportError", ValueError),
        ("scoring_workers.judge.errors.JudgeFailedError", RuntimeError),
    ],
)
def test_existing_except_clauses_still_catch(cls: str, standard: type[BaseException]) -> None:
    module, name = cls.rsplit(".", 1)
    klass = getattr(importlib.import_module(module), name)
    assert issubclass(klass, standard) and issubclass(klass, PRMPipelineError)


def test_root_and_subtrees_are_exported_where_a_user_looks() -> None:
    assert prm_pipeline.PRMPipelineError is PRMPipelineError
    assert {getattr(prm_pipeline, s.__name__) for s in SUBTREES} == SUBTREES


def test_errors_still_construct_and_pickle() -> None:
    from infra.startup import KafkaUnreachable
    from scoring_workers.judge.errors import CircuitOpenError

    refused = KafkaUnreachable("no broker at 127.0.0.1:1")
    assert str(refused) == "no broker at 127.0.0.1:1" and isinstance(refused, OSError)
    again = pickle.loads(pickle.dumps(CircuitOpenError("open", kind="circuit_open")))
    assert isinstance(again, errors.ScoringError) and again.kind == "circuit_open"


def _entry_points() -> list[object]:
    """(call, subtree, standard base, message start) for public entry points whose checks
    raise a typed error in place of a bare ValueError / RuntimeError."""
    import types

    import numpy as np
    import torch

    from infra import modes, reasons
    from infra.experiments import check_experiment_id
    from infra.retry import RetryPolicy
    from infra.schema import pack_array
    from prm_pipeline.verdict_dump import parse_time
    from scoring_workers.judge.hosts import split_host_port
    from scoring_workers.judge.limits import CircuitBreaker
    from scoring_workers.judge.transport import check_headers
    from shaper.filters import get_filter
    from shaper.reward_client import session_turn_rewards
    from shaper.reward_tags import tag_reward
    from shaper.shaping import grpo_outcome_advantages

    two_branches = types.SimpleNamespace(branches=[object(), object()], trajectory_id="t-1")
    cases = [
        (lambda: modes.check_coefficient("alpha", -1.0), errors.ConfigurationError, ValueError, "alpha must be"),
        (lambda: check_experiment_id("no spaces"), errors.ConfigurationError, ValueError, "experiment_id"),
        (lambda: RetryPolicy(retryable=bool, base_s=-1.0), errors.ConfigurationError, ValueError, "a retry policy"),
        (lambda: reasons.require("no_such_reason_code"), errors.ConfigurationError, ValueError, "reason code"),
        (
            lambda: pack_array(np.zeros((2, 2), dtype=np.int32), np.dtype("<i4")),
            errors.WireError,
            ValueError,
            "expected a 1-D array",
        ),
        (lambda: parse_time(""), errors.ConfigurationError, ValueError, "empty time"),
        (lambda: split_host_port("ftp://judge"), errors.ConfigurationError, ValueError, "'ftp://judge'"),
        (lambda: CircuitBreaker(failure_threshold=0), errors.ConfigurationError, ValueError, "failure_threshold"),
        (lambda: check_headers({"bad name": "x"}), errors.ConfigurationError, ValueError, "judge header name"),
        (lambda: get_filter("no_such_filter"), errors.ConfigurationError, ValueError, "unknown group filter"),
        (
            lambda: grpo_outcome_advantages(torch.zeros(2, 2), ["g", "g"]),
            errors.TrainingError,
            ValueError,
            "rewards must be 1-D",
        ),
        (lambda: tag_reward(1.0, 10_000), errors.TrainingError, ValueError, "member tag"),
        (
            lambda: session_turn_rewards(two_branches, group_id="g"),
            errors.TrainingError,
            RuntimeError,
            "group 'g': session 't-1' has 2 branches",
        ),
    ]
    return [pytest.param(*case, id=str(i)) for i, case in enumerate(cases)]


@pytest.mark.parametrize(("call", "subtree", "standard", "start"), _entry_points())
def test_public_checks_raise_typed_errors_that_old_clauses_still_catch(
    call: object, subtree: type[Exception], standard: type[Exception], start: str
) -> None:
    with pytest.raises(standard) as caught:
        call()  # type: ignore[operator]
    assert isinstance(caught.value, PRMPipelineError) and isinstance(caught.value, subtree)
    assert str(caught.value).startswith(start), str(caught.value)


def test_shaper_errors_sit_under_training_and_keep_their_bases() -> None:
    from shaper.errors import ShapingInputError, VerdictMismatch

    assert issubclass(ShapingInputError, errors.TrainingError) and issubclass(ShapingInputError, ValueError)
    assert issubclass(VerdictMismatch, errors.TrainingError) and issubclass(VerdictMismatch, RuntimeError)
    assert not issubclass(ShapingInputError, RuntimeError) and not issubclass(VerdictMismatch, ValueError)
