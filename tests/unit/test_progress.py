"""Progress on a terminal only (prm_pipeline/progress.py): drawn with records, rate and
counts when stdout is a terminal; nothing when it is not, or with --quiet."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from prm_pipeline.progress import progress_enabled, publish_progress, spinner


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_enabled_only_on_a_terminal_without_quiet() -> None:
    assert progress_enabled(False, Terminal())
    assert not progress_enabled(True, Terminal())
    assert not progress_enabled(False, io.StringIO())


def feed(on_progress, n: int) -> None:
    for _ in range(n):
        on_progress("validated", 1)
    on_progress("publishing", n)
    for _ in range(n):
        on_progress("published", 1)


def test_publish_progress_draws_both_phases_on_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("{}\n" * 3)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with publish_progress(path, enabled=True, console=console) as on_progress:
        feed(on_progress, 3)
    text = out.getvalue()
    assert "validating" in text and "publishing" in text and "3/3" in text and "records/s" in text


def test_nothing_is_drawn_when_disabled(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("{}\n")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)
    with publish_progress(path, enabled=False, console=console) as on_progress:
        feed(on_progress, 1)
    with spinner("bench x", enabled=False, console=console):
        print("result line")
    assert out.getvalue() == ""
