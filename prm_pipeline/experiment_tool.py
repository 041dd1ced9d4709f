"""``prm-pipeline experiment add FILE.yaml | remove ID | forget ID | list``: the operator's side of the registry.

``add`` checks the file as data (schema, sizes, quotas: :func:`infra.registry.load_spec_file`)
and, with the operator's own config at hand, the way a worker will
(the scorer modules under ``worker.allowed_scorer_modules``, only record-settable
arguments or the operator's ``worker.scorer_profiles``, the judge URLs under the judge
host allow-list) — so a typo fails here, in one line, and not on every worker.
It creates the experiment's two topics, then writes the registry record. Workers apply
it within about a second (docs/fleet.md); ``list`` shows what the registry holds.
``remove`` keeps the experiment's declaration in its removal record, so that its topics
stay auditable; ``forget``, once those topics are deleted, drops it (a tombstone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

import msgspec

from infra.config import ConfigError, PipelineConfig, load_config
from infra.escape import printable
from infra.experiments import trajectories_topic, verdicts_topic


def check_experiment_file(cfg: PipelineConfig, path: str) -> Any:
    """The experiment ``path`` declares, checked as data and as code (before any connection)."""
    from infra.registry import load_spec_file

    spec = load_spec_file(path)
    _check_as_code(cfg, spec)
    return spec


def _check_as_code(cfg: PipelineConfig, spec: Any) -> None:
    """Refuse what the workers would refuse (the worker's own preflight checks, under the
    allow-lists a registry record is held to), before anything is written."""
    from scoring_workers.judge.hosts import check_config_judge_hosts, effective_allow_list
    from scoring_workers.prm.capabilities import record_prm
    from scoring_workers.prm.resolve import check_scorer_entries

    try:
        prm = record_prm(
            spec.prm, cfg.worker.scorer_profiles, allowed_prefixes=cfg.worker.allowed_scorer_modules, key="prm"
        )
        check_config_judge_hosts(
            prm, effective_allow_list(cfg.prm, cfg.worker.allowed_judge_hosts, cfg.worker.scorer_profiles), "prm"
        )
        check_scorer_entries(prm, allowed_prefixes=cfg.worker.allowed_scorer_modules, key="prm")
    except (ImportError, TypeError) as exc:
        raise ConfigError(str(exc)) from None


def cmd_experiment(args: argparse.Namespace) -> int:
    from infra.kafka import ensure_topics
    from infra.registry import publish_removal, publish_spec, read_registry

    cfg = load_config(args.config)
    if args.action == "add":
        spec = check_experiment_file(cfg, args.target)
        topics = [
            trajectories_topic(cfg.topics.trajectories, spec.experiment_id),
            verdicts_topic(cfg.topics.verdicts, spec.experiment_id),
            cfg.topics.experiments,
        ]

        async def add() -> int:
            await ensure_topics(cfg.kafka, cfg.topics, topics)
            return await publish_spec(cfg, spec)

        offset = asyncio.run(add())
        print(
            f"experiment {spec.experiment_id} declared (registry offset {offset}): publish to {topics[0]}, "
            f"verdicts on {topics[1]}"
        )
        return 0
    if args.action == "remove":
        known = asyncio.run(read_registry(cfg))
        if args.target not in known:
            print(
                printable(
                    f"experiment {args.target!r} is not in the registry {cfg.topics.experiments} "
                    f"(declared: {sorted(known) or 'none'})"
                ),
                file=sys.stderr,
            )
            return 1
        # the removal keeps the declaration: `audit` re-scores the experiment's topics with it
        offset = asyncio.run(publish_removal(cfg, args.target, keep=known[args.target].spec))
        print(
            f"experiment {args.target} removed (registry offset {offset}): workers finish its open groups "
            "within its group timeout, then stop consuming it; its topics stay readable (verdicts, inspect, "
            "audit, dead-letters)"
        )
        return 0
    if args.action == "forget":
        return _forget(cfg, args.target)
    known = asyncio.run(read_registry(cfg))
    for experiment_id, entry in sorted(known.items()):
        when = datetime.fromtimestamp(entry.timestamp_ms / 1000, UTC).isoformat(timespec="seconds")
        if args.json:
            body = json.loads(msgspec.json.encode(entry.spec)) if entry.spec is not None else None
            print(
                json.dumps(
                    {
                        "experiment_id": experiment_id,
                        "offset": entry.offset,
                        "declared_at": when,
                        "spec": body,
                        "error": entry.error or None,
                    }
                )
            )
        elif entry.error:  # a registry key and its error are anyone's text (with Write on the registry)
            print(printable(f"{experiment_id}  REFUSED at offset {entry.offset} ({when}): {entry.error}"))
        else:
            spec = entry.spec
            assert spec is not None
            print(
                printable(
                    f"{experiment_id}  weight={spec.weight:g} max_in_flight={spec.max_in_flight or '-'} "
                    f"group_timeout_s={spec.group_timeout_s or 'worker default'} "
                    f"scorers={[s.path or f'profile:{s.profile}' for s in spec.prm.scorers]} "
                    f"(offset {entry.offset}, {when})"
                )
            )
    if not known and not args.json:
        print(f"no experiments in {cfg.topics.experiments} (the default experiment is the workers' config file)")
    return 0


def _forget(cfg: PipelineConfig, experiment_id: str) -> int:
    """Drop a removed experiment's kept declaration, once nothing is left to audit with it."""
    from infra.kafka import make_admin
    from infra.registry import publish_removal, read_registry

    entry = asyncio.run(read_registry(cfg, removed=True)).get(experiment_id)
    if entry is None or not entry.removal:
        state = "is not in the registry" if entry is None else "is declared: remove it first"
        print(f"experiment {experiment_id!r} {state} ({cfg.topics.experiments})", file=sys.stderr)
        return 1
    if entry.kept is None:
        print(f"experiment {experiment_id} keeps no declaration (registry offset {entry.offset}): nothing to forget")
        return 0
    topics = [
        trajectories_topic(cfg.topics.trajectories, experiment_id),
        verdicts_topic(cfg.topics.verdicts, experiment_id),
    ]

    async def existing() -> list[str]:
        admin = make_admin(cfg.kafka)
        await admin.start()
        try:
            return sorted(set(topics) & set(await admin.list_topics()))
        finally:
            await admin.close()

    if left := asyncio.run(existing()):
        print(
            f"experiment {experiment_id}: its topics {', '.join(left)} still hold its records, which `audit` "
            "re-scores with the declaration its removal kept; delete them first, then forget it",
            file=sys.stderr,
        )
        return 1
    offset = asyncio.run(publish_removal(cfg, experiment_id))
    print(f"experiment {experiment_id} forgotten (registry offset {offset}): its declaration is gone with its topics")
    return 0


class _Target(argparse.Action):
    """``target``, refused after ``list`` (which takes none) as a usage error, before any connection."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values is not None and namespace.action == "list":
            parser.error(
                f"experiment list takes no argument, got {values!r} (add FILE.yaml | remove ID | forget ID | list)"
            )
        setattr(namespace, self.dest, values)


def experiment_arguments(p: argparse.ArgumentParser) -> None:
    """``prm-pipeline experiment``'s arguments (the command is described in prm_pipeline.cli.COMMANDS)."""
    p.add_argument("action", choices=["add", "remove", "forget", "list"])
    p.add_argument(
        "target",
        nargs="?",
        action=_Target,
        help="add: the experiment's YAML file; remove: its id; forget: a removed experiment's id, once "
        "its topics are deleted (drops the declaration its removal kept for audit)",
    )
    p.add_argument("--json", action="store_true", help="list: one JSON object per experiment")


def checked_experiment(args: argparse.Namespace) -> int:
    if args.action in ("add", "remove", "forget") and not args.target:
        what = "FILE.yaml" if args.action == "add" else "ID"
        print(f"prm-pipeline experiment {args.action} needs {what}", file=sys.stderr)
        return 2
    return cmd_experiment(args)
