"""The ``prm-pipeline status`` command: one report (exit 0 healthy, 1 unhealthy), or a
report every ``--watch`` seconds, optionally served to Prometheus (``--metrics-port``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any

from infra.config import load_config
from infra.ports import log_listening, port_unavailable

log = logging.getLogger(__name__)

PIPED_WIDTH = 100_000  # columns when stdout is not a terminal: lines and table cells are never wrapped or cut


def status_arguments(p: argparse.ArgumentParser) -> None:
    """``prm-pipeline status``'s flags (the command is described in prm_pipeline.cli.COMMANDS)."""
    from prm_pipeline.flags import deprecated_alias, port, seconds

    p.add_argument("--json", action="store_true", help="one JSON object per report (for machines)")
    p.add_argument(
        "--watch",
        type=seconds,
        default=None,
        metavar="S",
        help="report every S seconds until interrupted (lag change is measured between reports)",
    )
    p.add_argument(
        "--sample",
        type=seconds,
        default=2.0,
        metavar="S",
        help="single report: seconds between the two lag readings that show a growing lag (default 2)",
    )
    dead = p.add_argument(
        "--dead-letter-lookback",
        type=seconds,
        default=600.0,
        metavar="S",
        help="count dead letters of the last S seconds (default 600)",
    )
    deprecated_alias(
        p,
        "--dead-letter-window",
        dead,
        type=seconds,
        convert=lambda minutes: minutes * 60,
        note=" (seconds; it took minutes)",
    )
    verdicts = p.add_argument(
        "--verdict-lookback",
        type=seconds,
        default=60.0,
        metavar="S",
        help="verdict rate and latency over the last S seconds (default 60)",
    )
    deprecated_alias(p, "--verdict-window", verdicts)
    read = p.add_argument(
        "--read-timeout", type=seconds, default=10.0, metavar="S", help="bound of each read in seconds (default 10)"
    )
    deprecated_alias(p, "--timeout", read)
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="P",
        help="with --watch: serve the latest report as Prometheus gauges on P (/metrics)",
    )
    from prm_pipeline.experiment_option import add_experiment_option

    add_experiment_option(
        p,
        "report on this experiment: lag on its topics, its trainer group, verdicts, dead "
        "letters and open groups (default: the default experiment's topics, the whole ledger)",
    )
    p.add_argument(
        "--worker-metrics",
        action="append",
        default=None,
        metavar="URL",
        help="with --experiment: a worker's /metrics URL (repeatable); the experiment's records, "
        "verdicts, in-flight records and slots are summed over them",
    )


def cmd_status(args: argparse.Namespace) -> int:
    if args.metrics_port is not None and args.watch is None:
        print("error: --metrics-port needs --watch S", file=sys.stderr)
        return 2
    if args.watch is not None and args.watch <= 0:
        print("error: --watch must be > 0 seconds", file=sys.stderr)
        return 2
    if args.worker_metrics and args.experiment is None:
        print("error: --worker-metrics needs --experiment ID (it reads that experiment's series)", file=sys.stderr)
        return 2
    bad = [u for u in args.worker_metrics or () if not u.startswith(("http://", "https://"))]
    if bad:
        print(
            f"error: --worker-metrics {bad[0]!r}: expected an http:// or https:// URL of a worker's /metrics",
            file=sys.stderr,
        )
        return 2
    cfg = load_config(getattr(args, "config", None))
    if args.experiment is not None and (refused := _undeclared(cfg, args.experiment, args.read_timeout)) is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(cfg, args))
    except KeyboardInterrupt:
        return 130


def _undeclared(cfg: Any, experiment: str, timeout_s: float) -> str | None:
    """Why ``experiment`` is refused (:func:`infra.registry.declared_experiment`), or None.
    A registry that cannot be read (Kafka down) refuses nothing: the report says Kafka is unreachable."""
    from infra.experiments import UnknownExperiment
    from infra.registry import declared_experiment

    async def check() -> None:
        await asyncio.wait_for(declared_experiment(cfg, experiment), timeout_s)

    try:
        asyncio.run(check())
    except UnknownExperiment as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - unreachable or slow: collect() reports the Kafka part
        return None
    return None


async def _run(cfg: Any, args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from prm_pipeline.status.collect import collect
    from prm_pipeline.status.render import render

    opts = {
        "dead_letter_window_s": args.dead_letter_lookback,
        "verdict_window_s": args.verdict_lookback,
        "timeout_s": args.read_timeout,
        "sample_s": args.sample,
        "experiment": args.experiment,
        "worker_metrics": tuple(args.worker_metrics or ()),
    }
    # Piped (a file, grep, a CI log) nothing is wrapped or cut: a line is as long as it needs.
    console = Console() if Console().is_terminal else Console(width=PIPED_WIDTH, soft_wrap=True)
    if args.watch is None:
        report, _ = await collect(cfg, **opts)
        if args.json:
            print(json.dumps(report.to_json()), flush=True)
        else:
            console.print(render(report))
        return 0 if report.healthy else 1

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    exporter = None
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        from prm_pipeline.status.exporter import StatusCollector, status_registry

        exporter = StatusCollector()
        try:
            server, _thread = start_http_server(args.metrics_port, registry=status_registry(exporter))
        except OSError as exc:  # one line naming the flag, exit 2 (prm_pipeline.cli), not a traceback
            raise port_unavailable(exc, "0.0.0.0", args.metrics_port, "status --metrics-port") from None
        log.setLevel(logging.INFO)  # the one line saying where (the CLI logs warnings only)
        log_listening(log, "metrics", f"http://0.0.0.0:{server.server_address[1]}/metrics")
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not args.json else None
    previous = None
    healthy = True
    if live is not None:
        live.start()
    try:
        while not stop.is_set():
            report, sample = await collect(cfg, previous=previous, **opts)
            previous = sample or previous
            healthy = report.healthy
            if exporter is not None:
                exporter.update(report)
            if args.json:
                print(json.dumps(report.to_json()), flush=True)
            elif live is not None:
                live.update(render(report), refresh=True)
            else:
                console.print(render(report))
                console.print()
            try:
                await asyncio.wait_for(stop.wait(), args.watch)
            except TimeoutError:
                pass
    finally:
        if live is not None:
            live.stop()
    return 0 if healthy else 1
