"""``prm-pipeline audit``: re-score recorded trajectories and compare with the recorded verdicts.

The audit answers one question: *would the scorers configured today give the trainer
exactly what the verdicts topic says it got?* It reads ``prm.verdicts`` and
``prm.trajectories`` with throw-away, group-less consumers (no consumer group, nothing
committed: production offsets are never touched), re-scores every recorded member
in-process with :class:`~scoring_workers.prm.PRMRunner` and compares, member by member,
what re-scoring produced with what the verdict recorded. It needs no Redis: the
ledger's state is not an input, only the two topics are.

The package has one module per job, each importing only the ones listed before it:

1. :mod:`~prm_pipeline.audit.compare` -- **pure comparison** (:func:`compare_session`,
   :func:`compare_group`, :func:`summarize_group`, :class:`Tolerance`,
   :class:`ScoringScope`): wire structs in, :class:`GroupFinding` out. No I/O, no
   runner; unit-tested on hand-built verdicts.
2. :mod:`~prm_pipeline.audit.rescoring` -- **re-scoring** (:func:`build_runners`,
   :func:`scorer_is_deterministic`, :func:`rescore`): builds the configured scorers,
   re-runs the deterministic ones on one trajectory the way the worker does.
3. :mod:`~prm_pipeline.audit.auditor` -- **bookkeeping** (:class:`Auditor`,
   :class:`AuditReport`): decodes records, matches verdict sessions to trajectories by
   ``trajectory_id``, re-scores each referenced trajectory once with bounded
   concurrency, keeps only the comparisons.
4. :mod:`~prm_pipeline.audit.replay` -- **Kafka** (:func:`read_snapshot`,
   :func:`parse_offsets`, :class:`AuditError`): reads a topic up to the end it had when
   the audit started, from ``--from-offsets`` or ``--since``.
5. :mod:`~prm_pipeline.audit.report` -- **output** (:func:`render_summary`,
   :func:`write_findings`): the progress bar, the summary tables, ``--out``.
6. :mod:`~prm_pipeline.audit.run` -- **one audit end to end** (:class:`AuditOptions`,
   :func:`audit`, :func:`run_audit`).
7. :mod:`~prm_pipeline.audit.cli` -- **the command line** (:func:`add_audit_parser`,
   :func:`options_from_args`, :func:`cmd_audit`).

Every public name is re-exported here, so callers import from ``prm_pipeline.audit``.
The re-exports are resolved on first use (PEP 562): ``prm-pipeline`` registers the
``audit`` command on every run, and importing the package must not import the scorer
runner (torch) for commands that never audit (``status``, ``verdicts``, ...).
See ``docs/audit.md`` for the rules (tolerance, failed members, non-deterministic
scorers, duplicate and conflicting verdicts) and the output format.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prm_pipeline.audit.auditor import Auditor, AuditReport
    from prm_pipeline.audit.cli import add_audit_parser, cmd_audit
    from prm_pipeline.audit.cli import options_from_args as options_from_args
    from prm_pipeline.audit.compare import (
        ATOL,
        RTOL,
        Difference,
        GroupFinding,
        ScoringScope,
        SessionComparison,
        Tolerance,
        compare_group,
        compare_session,
        distinct_verdicts,
        summarize_group,
    )
    from prm_pipeline.audit.compare import DEFAULT_TOLERANCE as DEFAULT_TOLERANCE
    from prm_pipeline.audit.compare import GROUP_OUTCOMES as GROUP_OUTCOMES
    from prm_pipeline.audit.compare import DifferenceKind as DifferenceKind
    from prm_pipeline.audit.compare import GroupOutcome as GroupOutcome
    from prm_pipeline.audit.compare import SessionOutcome as SessionOutcome
    from prm_pipeline.audit.replay import AuditError, parse_offsets, read_snapshot
    from prm_pipeline.audit.report import render_summary as render_summary
    from prm_pipeline.audit.report import write_findings as write_findings
    from prm_pipeline.audit.rescoring import build_runners as build_runners
    from prm_pipeline.audit.rescoring import rescore, scorer_is_deterministic
    from prm_pipeline.audit.run import AuditOptions, audit, run_audit
    from scoring_workers.prm.errors import failure_code as failure_code

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("Auditor", "AuditReport"), "prm_pipeline.audit.auditor"),
    **dict.fromkeys(("add_audit_parser", "cmd_audit", "options_from_args"), "prm_pipeline.audit.cli"),
    **dict.fromkeys(
        (
            "ATOL",
            "RTOL",
            "Difference",
            "GroupFinding",
            "ScoringScope",
            "SessionComparison",
            "Tolerance",
            "compare_group",
            "compare_session",
            "distinct_verdicts",
            "summarize_group",
            "DEFAULT_TOLERANCE",
            "GROUP_OUTCOMES",
            "DifferenceKind",
            "GroupOutcome",
            "SessionOutcome",
        ),
        "prm_pipeline.audit.compare",
    ),
    **dict.fromkeys(("AuditError", "parse_offsets", "read_snapshot"), "prm_pipeline.audit.replay"),
    **dict.fromkeys(("render_summary", "write_findings"), "prm_pipeline.audit.report"),
    **dict.fromkeys(("build_runners", "rescore", "scorer_is_deterministic"), "prm_pipeline.audit.rescoring"),
    **dict.fromkeys(("AuditOptions", "audit", "run_audit"), "prm_pipeline.audit.run"),
    "failure_code": "scoring_workers.prm.errors",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# ``__all__`` is the former module's, unchanged; the ``X as X`` imports above are the
# other public names it defined, still importable from here (``build_runners``, ...).
__all__ = [
    "ATOL",
    "RTOL",
    "AuditError",
    "AuditOptions",
    "AuditReport",
    "Auditor",
    "Difference",
    "GroupFinding",
    "ScoringScope",
    "SessionComparison",
    "Tolerance",
    "add_audit_parser",
    "audit",
    "cmd_audit",
    "compare_group",
    "compare_session",
    "distinct_verdicts",
    "parse_offsets",
    "read_snapshot",
    "rescore",
    "run_audit",
    "scorer_is_deterministic",
    "summarize_group",
]
