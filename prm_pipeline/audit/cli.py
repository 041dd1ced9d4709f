"""``prm-pipeline audit`` on the command line: the parser, its flags and the command.

:func:`audit_arguments` adds the subcommand's flags (``prm_pipeline.cli.COMMANDS``
describes the command, so ``prm-pipeline --help`` imports this package: keep heavy
imports such as torch and rich out of module level);
:func:`options_from_args` turns the flags into
:class:`~prm_pipeline.audit.run.AuditOptions`; :func:`cmd_audit` runs it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import TYPE_CHECKING, Any

from infra.config import PipelineConfig
from infra.experiments import trajectories_topic, verdicts_topic
from prm_pipeline.audit.compare import ATOL, RTOL, Tolerance
from prm_pipeline.audit.replay import parse_offsets
from prm_pipeline.experiment_option import add_experiment_option, experiment_of
from prm_pipeline.flags import deprecated_alias, positive_int, seconds

if TYPE_CHECKING:  # prm_pipeline.audit.run imports the scorer runner (torch): only when auditing
    from prm_pipeline.audit.run import AuditOptions


# =========================================================================== command line
def _tolerance(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def add_audit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``audit`` on the CLI's subparsers; ``func`` takes the Namespace, returns the exit code."""
    from prm_pipeline.cli import COMMANDS, add_command

    return add_command(subparsers, COMMANDS["audit"])


def audit_arguments(p: argparse.ArgumentParser) -> None:
    """``prm-pipeline audit``'s flags."""
    from prm_pipeline.verdict_dump import since_arg

    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--since",
        type=since_arg,
        metavar="TIME",
        default=None,
        help="only records timestamped at/after TIME: ISO-8601 (2026-11-30T14:05Z) or an age (15m, 2h, 1d)",
    )
    where.add_argument(
        "--from-offsets",
        action="append",
        metavar="TOPIC:PARTITION:OFFSET,...",
        default=None,
        help="start partitions at these offsets (others from the beginning); TOPIC may be "
        "'trajectories' or 'verdicts'; repeatable",
    )
    p.add_argument(
        "--groups", nargs="+", metavar="ID", default=None, help="audit only these group ids (space- or comma-separated)"
    )
    p.add_argument("--out", metavar="FILE", default=None, help="write one JSON line per group to FILE")
    p.add_argument("--rtol", type=_tolerance, default=RTOL, metavar="R", help=f"relative tolerance (default {RTOL:g})")
    p.add_argument("--atol", type=_tolerance, default=ATOL, metavar="A", help=f"absolute tolerance (default {ATOL:g})")
    p.add_argument(
        "--concurrency", type=positive_int, default=16, metavar="N", help="trajectories re-scored at once (16)"
    )
    timeout = p.add_argument(
        "--scorer-timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="bound of each trajectory's re-scoring in seconds (default worker.scorer_timeout_s)",
    )
    deprecated_alias(p, "--timeout", timeout)
    p.add_argument(
        "--max-differences",
        type=positive_int,
        default=100,
        metavar="N",
        help="differences kept per group in --out (100)",
    )
    p.add_argument("--show", type=int, default=10, metavar="N", help="differing groups listed in the summary (10)")
    quiet = p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar (default: shown when stderr is a terminal)"
    )
    deprecated_alias(p, "--no-progress", quiet)
    add_experiment_option(
        p,
        "audit this experiment: read prm.trajectories.ID and prm.verdicts.ID, match its "
        "records only (default: trainer.experiment)",
    )


def options_from_args(args: argparse.Namespace, cfg: PipelineConfig) -> AuditOptions:
    from prm_pipeline.audit.run import AuditOptions

    experiment = experiment_of(args, cfg)
    aliases = {
        "trajectories": trajectories_topic(cfg.topics.trajectories, experiment),
        "verdicts": verdicts_topic(cfg.topics.verdicts, experiment),
    }
    groups = None
    if args.groups:
        groups = [g for item in args.groups for g in item.split(",") if g]
    return AuditOptions(
        since_ms=args.since,
        from_offsets=parse_offsets(args.from_offsets, aliases=aliases) if args.from_offsets else None,
        groups=groups,
        out=args.out,
        tolerance=Tolerance(rtol=args.rtol, atol=args.atol),
        concurrency=args.concurrency,
        timeout_s=args.scorer_timeout,
        max_differences=args.max_differences,
        progress=False if args.quiet else None,
        show=args.show,
        experiment=experiment,
    )


def cmd_audit(args: argparse.Namespace) -> int:
    """``prm-pipeline audit``: exit 0 when nothing differs, 1 when something does, 2 on errors."""
    from infra.config import load_config
    from prm_pipeline.audit.run import run_audit

    cfg = load_config(getattr(args, "config", None))
    try:
        options = options_from_args(args, cfg)
    except ValueError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    code = run_audit(cfg, options)
    print(f"audit finished in {time.monotonic() - started:.1f}s (exit {code})", file=sys.stderr)
    return code
