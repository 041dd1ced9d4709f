"""Built-in scorers.

Exports are resolved lazily (PEP 562 ``__getattr__``): importing this package costs
nothing, and a scorer with heavy dependencies (an HTTP judge) is imported only when a
config names it. To add a scorer, add a module here and one line to ``_EXPORTS``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scoring_workers.scorers.length_budget import LengthBudgetScorer  # noqa: F401 - for type checkers; __getattr__ loads it

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LengthBudgetScorer": "scoring_workers.scorers.length_budget",
    "OpenClawJudgeScorer": "scoring_workers.scorers.openclaw",
    "JudgeScorerResult": "scoring_workers.scorers.openclaw",
    "OPDTeacherScorer": "scoring_workers.scorers.opd",
    "JudgeFailedError": "scoring_workers.judge.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
