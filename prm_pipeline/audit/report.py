"""What an audit shows and writes: the progress bar, the summary tables, ``--out``.

:func:`_progress` builds the rich progress bar drawn on stderr while reading and
re-scoring; :func:`render_summary` prints the end-of-audit tables;
:func:`write_findings` writes one JSON line per :class:`GroupFinding` (the
``--out`` format, docs/audit.md). rich is imported inside the functions, so
importing the package (``prm-pipeline --help``) does not pay for it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, Any

import msgspec

from prm_pipeline.audit.auditor import AuditReport
from prm_pipeline.audit.compare import GROUP_OUTCOMES, Difference, GroupFinding


def _progress(stderr: IO[str], enabled: bool | None) -> Any:  # rich types stay local to this function
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:,.0f}/s", style="progress.data.speed")

    console = Console(file=stderr, stderr=stderr is sys.stderr)
    if enabled is None:
        enabled = console.is_terminal
    return Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        refresh_per_second=5,
    )


def render_summary(report: AuditReport, out: IO[str], *, show: int = 10) -> None:
    """The end-of-audit tables: group outcomes, member outcomes, the first differing groups."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out, width=max(100, getattr(out, "columns", 0) or 0), soft_wrap=False)
    scope = report.scope
    counts = report.counts
    table = Table(title="audit summary (groups)")
    table.add_column("outcome")
    table.add_column("groups", justify="right")
    for outcome in GROUP_OUTCOMES:
        style = "bold red" if outcome == "differs" and counts[outcome] else None
        table.add_row(outcome.replace("_", " "), str(counts[outcome]), style=style)
    console.print(table)
    sessions = report.sessions
    if sessions:
        console.print("members: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sessions.items()))
    r = report.records
    console.print(
        f"records read: {r.get('verdict_records', 0)} verdicts, {r.get('trajectory_records', 0)} trajectories"
        + (
            f"; undecodable: {r.get('undecodable_verdicts', 0)} verdicts, "
            f"{r.get('undecodable_trajectories', 0)} trajectories"
            if r.get("undecodable_verdicts") or r.get("undecodable_trajectories")
            else ""
        )
    )
    if r.get("streamed_turn_records") or r.get("streamed_end_records"):
        console.print(
            f"streamed session records (counted, not re-scored): {r.get('streamed_turn_records', 0)} turn, "
            f"{r.get('streamed_end_records', 0)} end"
        )
    if not scope.enabled:
        console.print("scoring is disabled in the config: verdicts are expected to carry no rewards")
    elif scope.not_rescored:
        console.print(f"not re-run (non-deterministic): {', '.join(sorted(scope.not_rescored))}")
    differing = [f for f in report.findings if f.outcome == "differs"]
    if differing and show > 0:
        detail = Table(title=f"differing groups (first {min(show, len(differing))} of {len(differing)})")
        for name in ("group", "kind", "session", "turn", "scorer", "max |diff|"):
            detail.add_column(name, overflow="fold")
        for finding in differing[:show]:
            located = [d for d in finding.differences if d.session_id or d.turn]
            d = (located or finding.differences or [Difference(kind="verdict")])[0]
            detail.add_row(
                finding.group_id,
                d.kind,
                d.session_id or "",
                d.turn or "",
                d.scorer or "",
                "" if finding.max_abs_diff is None else f"{finding.max_abs_diff:.6g}",
            )
        console.print(detail)
    if report.missing_groups:
        missing = ", ".join(report.missing_groups)
        if len(report.missing_groups) == len(report.requested_groups):
            console.print(
                f"none of the --groups was found (no verdict, trajectory or discard names them in the "
                f"range read): {missing}; check the ids (matched exactly) and the range (exit 2)",
                style="bold red",
                soft_wrap=True,
            )
        else:
            console.print(
                f"--groups not found ({len(report.missing_groups)} of {len(report.requested_groups)}; "
                f"no record in the range read names them): {missing}",
                style="yellow",
                soft_wrap=True,
            )
    if report.resume_offsets:
        console.print(f"next audit from here: --from-offsets {report.resume_offsets}", soft_wrap=True)


def write_findings(path: str, findings: Iterable[GroupFinding]) -> int:
    encoder = msgspec.json.Encoder()
    n = 0
    with open(path, "wb") as fh:
        for finding in findings:
            fh.write(encoder.encode(finding) + b"\n")
            n += 1
    return n
