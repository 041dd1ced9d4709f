"""``prm-pipeline status`` on a screen: the records' text in a report reaches the terminal escaped,
and rich reads no markup in it."""

from __future__ import annotations

import io
import time

from rich.console import Console

from prm_pipeline.status.render import render
from prm_pipeline.status.report import GroupLag, LedgerSummary, PartitionLag, Problem, StatusReport

HOSTILE = "g-1\n2030-01-01 00:00:00,000 ERROR forged\x1b[31m\u202e[bold red]loud[/bold red]"


def test_a_hostile_group_id_and_problem_text_are_shown_escaped_and_without_markup() -> None:
    report = StatusReport(
        at=time.time(),
        lags=[GroupLag("workers", f"workers[{HOSTILE}]", "traj", [PartitionLag(0, 5, 0, 5)], 5, 1, "Stable")],
        ledger=LedgerSummary(
            indexed=1,
            sampled=1,
            open=1,
            decided=0,
            gone=0,
            group_timeout_s=60,
            oldest_open_group=HOSTILE,
            oldest_open_age_s=50.0,
        ),
        problems=[Problem("critical", "group_near_timeout", f"group {HOSTILE} is near its timeout")],
    )
    out = io.StringIO()
    Console(file=out, force_terminal=False, width=1000).print(render(report))  # no styles: an ESC is the record's
    screen = out.getvalue()
    shown = [line for line in screen.splitlines() if "forged" in line]
    assert len(shown) == 3, repr(screen)  # the lag row, the ledger line and the problem, each one line
    assert all(
        "g-1\\n2030-01-01 00:00:00,000 ERROR forged\\x1b[31m\\u202e[bold red]loud[/bold red]" in line for line in shown
    ), screen
    assert "\u202e" not in screen and not any(line.startswith("2030-01-01") for line in screen.splitlines())
    assert "\x1b" not in screen
