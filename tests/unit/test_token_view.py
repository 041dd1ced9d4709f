"""``prm-pipeline inspect``'s token view (prm_pipeline/token_view.py): a verdict's ids, the model's tokens
and the scorers' text reach the screen escaped, rich reads no markup in them, and a trajectory published
without a ``policy_version`` says its version is unknown, never ``policy vNone``."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from prm_pipeline.token_view import BranchView, TurnView, branch_views, render_html, render_terminal, verdict_record
from tests.unit.test_batch import accepted_group

REPO = Path(__file__).resolve().parents[2]

HOSTILE = "g-1\n2030-01-01 00:00:00,000 ERROR forged\x1b[31m\u202e[bold red]loud[/bold red]"
ESCAPED = "g-1\\n2030-01-01 00:00:00,000 ERROR forged\\x1b[31m\\u202e[bold red]loud[/bold red]"


def test_ids_tokens_and_scorer_text_are_shown_escaped_and_without_markup() -> None:
    turn = TurnView(
        interaction_id=HOSTILE,
        prompt_ids=[1],
        output_ids=[2, 3],
        rewards=[0.5, -0.5],
        results=[{"scorer_name": HOSTILE, "reward": 0.5, "observations": [{"metric_id": "m", "value": HOSTILE}]}],
        audit=[{"scorer": HOSTILE, "votes": 1, "vote_0": HOSTILE}],
    )
    view = BranchView(HOSTILE, "s", "t", "leaf", 1.0, 0, turns=[turn])
    tokens = {1: "prompt line one\nline two", 2: "[bold]out[/bold]", 3: "\x1b]8;;http://evil\x07link\r"}
    out = io.StringIO()
    render_terminal(
        [view], lambda ids: [tokens[i] for i in ids], console=Console(file=out, force_terminal=False, width=2000)
    )
    screen = out.getvalue()
    assert "\x1b" not in screen and "\x07" not in screen and "\r" not in screen and "\u202e" not in screen
    assert not any(line.startswith("2030-01-01") for line in screen.splitlines()), screen
    assert screen.count(ESCAPED) >= 5, screen  # the rule, the turn's id, the scorer, its observation, the votes
    assert "prompt line one\nline two" in screen  # the model's own line breaks stay
    assert "[bold]out[/bold]\\x1b]8;;http://evil\\x07link\\r" in screen


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


# --------------------------------------------------------------------------- inspect --session
def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.slow  # the CLI as a child process
def test_a_session_beyond_the_first_groups_is_found_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(verdict_record(accepted_group(f"g{i}"))) + b"\n" for i in range(5)))
    found = _inspect("--verdicts", str(path), "--session", "g4-s1")  # the 5th group; --max-groups is 3
    assert found.returncode == 0, found.stderr
    assert "g4 · g4-s1 · leaf g4-s1-t0" in found.stdout
    assert "g0" not in found.stdout and "g4-s0" not in found.stdout  # only that session is shown

    missing = _inspect("--verdicts", str(path), "--session", "g9-s0")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip() == f"inspect: no session 'g9-s0' in {path} (5 verdict(s) read)"
