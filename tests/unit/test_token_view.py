"""The token view's header (prm_pipeline/token_view.py): a trajectory published without a
``policy_version`` says its version is unknown, never ``policy vNone``."""

from __future__ import annotations

import io

from rich.console import Console

from prm_pipeline.token_view import branch_views, render_html, render_terminal, verdict_record
from tests.unit.test_batch import accepted_group


def _views(policy_version: int | None):  # type: ignore[no-untyped-def]
    record = verdict_record(accepted_group("g1"))
    for session in record["sessions"]:
        session["policy_version"] = policy_version
    return branch_views(record)


def test_an_unknown_policy_version_is_said_so() -> None:
    views = _views(None)
    assert views and all(v.policy == "policy version unknown" for v in views)
    console = Console(file=io.StringIO(), width=200)
    render_terminal(views, console=console)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    html = render_html(views)
    assert "vNone" not in shown and "vNone" not in html
    assert "policy version unknown" in shown and "policy version unknown" in html
    assert "policy v7" in render_html(_views(7))
