"""docs/security.md's table of who may set each built-in scorer argument is the declarations' own."""

from __future__ import annotations

import re
from pathlib import Path

from scoring_workers.prm.capabilities import constructor_arguments, settable_fields

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
START, END = "<!-- capability-table:start -->", "<!-- capability-table:end -->"


def capability_table() -> str:
    """The markdown table: per built-in scorer, what a record may set and what only the operator may (why)."""
    from scoring_workers.scorers import LengthBudgetScorer, OPDTeacherScorer, OpenClawJudgeScorer

    rows = ["| scorer | a record may set | operator-only (why) |", "|---|---|---|"]
    for cls in (LengthBudgetScorer, OpenClawJudgeScorer, OPDTeacherScorer):
        settable = ", ".join(f"`{n}`" for n in settable_fields(cls)) or "—"
        only = [n for n in constructor_arguments(cls) if n not in settable_fields(cls)]
        why = "; ".join(f"`{n}`: {cls.operator_only.get(n, 'not declared record-settable')}" for n in only) or "—"
        rows.append(f"| `{cls.__name__}` | {settable} | {why} |")
    return "\n".join(rows)


def test_docs_security_table_matches_the_scorers_declarations() -> None:
    text = DOC.read_text()
    found = re.search(re.escape(START) + r"\n(.*?)\n?" + re.escape(END), text, re.S)
    assert found, f"{DOC.name} lost its capability table markers"
    expected = capability_table()
    assert found.group(1).strip() == expected, f"update the table in {DOC.name} to:\n{expected}"


if __name__ == "__main__":  # python -m tests.unit.test_docs_capabilities: rewrite the table in place
    body = DOC.read_text()
    head, rest = body.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{capability_table()}\n{END}{tail}")
