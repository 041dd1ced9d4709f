"""``prm-pipeline status`` on a screen: one rich renderable per report (plain text when
stdout is not a terminal).

Group ids, reasons, error classes and problem messages are the records' text: every line
goes to rich through :func:`infra.escape.rich_text` (escaped, and never read as markup)."""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.table import Table

from infra.escape import rich_text
from prm_pipeline.status.report import ExperimentSummary, StatusReport


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def fleet_line(fleet: ExperimentSummary) -> str:
    """One line of the experiment's series summed over the workers read."""
    read = f"{fleet.sources} worker(s) read" + (f", {len(fleet.unreachable)} unreachable" if fleet.unreachable else "")
    if not fleet.present:
        return f"fleet ({read}): no series of experiment {fleet.experiment}"
    records = ", ".join(f"{k} {v:.0f}" for k, v in sorted(fleet.records.items())) or "none"
    verdicts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(fleet.verdicts.items())) or "none"
    in_flight = "-" if fleet.in_flight is None else f"{fleet.in_flight:.0f}"
    slots = "-" if fleet.slots is None else f"{fleet.slots:.0f}"
    return f"fleet ({read}): records {records}; verdicts {verdicts}; in flight {in_flight} of {slots} slots"


def render(report: StatusReport) -> Group:
    """The report as a header line, a lag table, and ledger / verdict / dead-letter lines."""
    when = time.strftime("%H:%M:%S", time.localtime(report.at))
    about = f" of experiment {report.experiment}" if report.experiment is not None else ""
    head = rich_text(f"prm-pipeline status{about} at {when}: ")
    head.append("HEALTHY" if report.healthy else "UNHEALTHY", style="bold green" if report.healthy else "bold red")
    parts: list[RenderableType] = [head]
    if report.lags:
        table = Table(box=None, pad_edge=False, show_edge=False)
        for col in ("group", "topic", "members", "lag", "change", "per partition"):
            table.add_column(col, justify="right" if col in ("members", "lag", "change") else "left")
        for g in report.lags:
            change = "-" if g.growth is None else f"{g.growth:+d} in {g.window_s:.0f}s"
            per = " ".join(f"{p.partition}:{p.lag}" for p in g.partitions)
            members = "?" if g.members is None else str(g.members)
            table.add_row(
                *(
                    rich_text(cell)
                    for cell in (f"{g.role} ({g.group})", g.topic, f"{members} [{g.state}]", str(g.total), change, per)
                )
            )
        parts.append(table)
    beats = report.workers
    if beats is not None:
        alive = ", ".join(f"{b.worker_id} ({b.age_s:.0f}s)" for b in beats.alive) or "none"
        silent = ", ".join(f"{b.worker_id} ({b.age_s:.0f}s)" for b in beats.silent)
        parts.append(
            rich_text(
                f"workers alive (heartbeat < {beats.alive_s:g}s): {len(beats.alive)}: {alive}"
                f"{'; silent: ' + silent if silent else ''}"
            )
        )
    ledger = report.ledger
    if ledger is not None:
        timeout = ledger.oldest_open_timeout_s or ledger.group_timeout_s
        oldest = (
            f"oldest open {_seconds(ledger.oldest_open_age_s)} of its {timeout:g}s timeout ({ledger.oldest_open_group})"
            if ledger.oldest_open_age_s is not None
            else "none open"
        )
        memory = ", ".join(
            f"{n.node} {_bytes(n.used_bytes)}" + (f" of {_bytes(n.max_bytes)}" if n.max_bytes else "")
            for n in ledger.memory
        )
        more = f" (state read for the {ledger.sampled} due soonest)" if ledger.sampled < ledger.indexed else ""
        parts.append(
            rich_text(
                f"ledger: {ledger.open} open, {ledger.decided} decided awaiting their verdict{more}; "
                f"{oldest}; redis memory {memory}"
            )
        )
    v = report.verdicts
    if v is not None:
        statuses = ", ".join(f"{s} {n}" for s, n in sorted(v.by_status.items())) or "none"
        reasons = ", ".join(f"{r} x{n}" for r, n in v.top_reasons)
        stages = " ".join(f"{s} {_seconds(t)}" for s, t in v.stage_p50_s.items())
        parts.append(
            rich_text(
                f"verdicts (last {v.window_s:.0f}s): {v.count} = {v.per_second:.1f}/s ({statuses})"
                f"{'; top reasons ' + reasons if reasons else ''}; latency p50 {_seconds(v.latency_p50_s)} "
                f"p99 {_seconds(v.latency_p99_s)}{'; stage p50 ' + stages if stages else ''}"
            )
        )
    fleet = report.fleet
    if fleet is not None:
        parts.append(rich_text(fleet_line(fleet)))
    dl = report.dead_letters
    if dl is not None:
        top = ", ".join(f"{r} x{n}" for r, n in dl.top)
        parts.append(
            rich_text(
                f"dead letters (last {dl.window_s:.0f}s): {dl.count}{'+' if dl.truncated else ''}"
                f"{' — ' + top if top else ''}"
            )
        )
    for p in report.problems:
        parts.append(
            rich_text(
                f"{p.severity.upper():8} {p.check}: {p.message}", style="red" if p.severity == "critical" else "yellow"
            )
        )
    return Group(*parts)
