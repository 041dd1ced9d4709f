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
SUBTREES = {errors.ConfigurationError, errors.WireError, errors.ServiceError, errors.ScoringError,
            errors.TrainingError}


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
    found = {obj for m in modules for obj in vars(m).values()
             if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == m.__name__
             and not obj.__name__.startswith("_")}
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def test_every_public_exception_derives_from_the_root() -> None:
    found = _public_exceptions()
    assert len(found) >= 20, [c.__name__ for c in found]
    outside = [f"{c.__module__}.{c.__name__}" for c in found if not issubclass(c, PRMPipelineError)]
    assert outside == []
    untyped = [c.__name__ for c in found if c not in SUBTREES | {PRMPipelineError}
               and not any(issubclass(c, s) for s in SUBTREES) and c.__name__ != "AuditError"]
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


@pytest.mark.parametrize(("cls", "standard"), [
    ("infra.config.ConfigError", ValueError),
    ("infra.schema.InvalidMessage", ValueError),
    ("infra.startup.KafkaUnreachable", ConnectionError),
    ("infra.kafka.KafkaAuthError", RuntimeError),
    ("shaper.batch.ConcatExportError", ValueError),
    ("scoring_workers.judge.errors.JudgeFailedError", RuntimeError),
])
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
