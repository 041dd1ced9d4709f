"""prm-pipeline: one command line for every part of the pipeline.

Each subcommand reads ``--config FILE`` (or ``$PRM_CONFIG``) plus ``PRM_*`` environment
overrides through :func:`infra.config.load_config`.

Every command is one :class:`Command` in :data:`COMMANDS`: its name, help, flags, the
services it waits for, the files and inputs checked before it connects, and its exit
status on errors. ``--help``, the start-up checks and :func:`main` read that table and
nothing else. Flag names and their one meaning are :data:`prm_pipeline.flags.VOCABULARY`.
Development commands (``bench``, ``demo``, ``fake-judge``, ``model-server``) load their
modules only when run: the product imports neither ``tests`` nor ``prm_pipeline.demo``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra import event_loop
from infra.config import COMBINED_MODES, SHAPING_MODES, ConfigError, PipelineConfig, load_config
from infra.escape import printable
from infra.experiments import UnknownExperiment, trajectories_topic, verdicts_topic
from infra.kafka import require_topics
from infra.logs import configure_logging
from infra.registry import declared_experiment, recorded_experiment, removed_note
from infra.startup import Service, ServiceUnavailable, wait_for_services
from prm_pipeline.experiment_option import add_experiment_option, experiment_of
from prm_pipeline.flags import deprecated_alias, port, positive_int, seconds

__all__ = ["COMMANDS", "Command", "add_command", "build_parser", "main", "positive_int"]

log = logging.getLogger("prm_pipeline")


def _load(args: argparse.Namespace) -> PipelineConfig:
    return load_config(args.config)


# --------------------------------------------------------------------------- up / topics
def cmd_up(args: argparse.Namespace) -> int:
    """Run the embedded broker + Redis in the foreground until SIGINT/SIGTERM."""
    from infra.local import LOCAL_BROKER_ENV, LocalStack
    from prm_pipeline.foreground import StopSignals

    cfg = _load(args)
    with (
        StopSignals() as stop,
        LocalStack(
            cfg.local.data_dir, broker_binary=cfg.local.broker_binary, redis_binary=cfg.local.redis_binary
        ) as stack,
    ):
        if args.create_topics:
            import msgspec

            from infra.kafka import ensure_topics

            kafka = msgspec.structs.replace(cfg.kafka, bootstrap=stack.kafka_bootstrap)
            for state in asyncio.run(ensure_topics(kafka, cfg.topics)).values():
                print(f"# {state}", file=sys.stderr, flush=True)  # stdout stays the env lines to eval
        print(f"PRM_KAFKA_BOOTSTRAP={stack.kafka_bootstrap}", flush=True)
        print(f"PRM_REDIS_URL={stack.redis_url}", flush=True)
        for name, value in LOCAL_BROKER_ENV.items():  # the embedded broker's workarounds (infra.local)
            print(f"{name}={value}", flush=True)
        print(f"# logs in {stack.data_dir / 'logs'}; Ctrl-C stops both", file=sys.stderr, flush=True)

        def exited() -> int | None:
            for svc in (stack.broker, stack.redis):
                if not svc.running:
                    print(f"{svc.name} exited unexpectedly; see {svc.log_path}", file=sys.stderr)
                    return 1
            return None

        code = stop.wait(exited)
        started = time.monotonic()
    print(f"# stopped both in {time.monotonic() - started:.2f}s", file=sys.stderr, flush=True)
    return code


def cmd_topics(args: argparse.Namespace) -> int:
    """The configured topics, then the two topics of every experiment the registry declares."""
    from infra.experiments import trajectories_topic, verdicts_topic
    from infra.kafka import TopicState, ensure_topics
    from infra.registry import read_registry

    cfg = _load(args)

    async def create() -> dict[str, TopicState]:
        result = await ensure_topics(cfg.kafka, cfg.topics)
        declared = [e for e, entry in sorted((await read_registry(cfg)).items()) if entry.spec is not None]
        names = [
            t
            for e in declared
            for t in (trajectories_topic(cfg.topics.trajectories, e), verdicts_topic(cfg.topics.verdicts, e))
        ]
        if names:
            result.update(await ensure_topics(cfg.kafka, cfg.topics, names))
        return result

    for state in asyncio.run(create()).values():
        print(state)
    return 0


# --------------------------------------------------------------------------- pipeline parts
def cmd_worker(args: argparse.Namespace) -> int:
    """One scoring worker; SIGTERM/SIGINT drain in-flight work, commit, and exit 0."""
    # Until the event loop takes over, a stop request simply exits: nothing is held yet.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))
    from scoring_workers.worker import Worker

    cfg = _load(args)
    if args.metrics_port is not None:
        import msgspec

        cfg = msgspec.structs.replace(cfg, worker=msgspec.structs.replace(cfg.worker, metrics_port=args.metrics_port))
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)

    async def main() -> None:
        stop = _stop_on_signals()
        worker = Worker(cfg, worker_id=args.worker_id, concurrency=args.concurrency)
        frozen = asyncio.create_task(_freeze_gc_when_ready(worker.ready))
        try:
            await worker.run(stop)
        finally:
            frozen.cancel()

    logging.getLogger("scoring_workers").info("event loop: %s", event_loop.loop_name())
    event_loop.run(main())
    return 0


def _stop_on_signals() -> asyncio.Event:
    """An event that SIGINT and SIGTERM set (call inside the command's event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _freeze_gc_when_ready(ready: asyncio.Event) -> None:
    """Move what start-up built (torch, scorers, clients) out of the collector's sight.

    Those objects live as long as the process, yet every full collection walks them
    all; under a judge-bound load that walk was a fifth of the worker's CPU per judge
    call (docs/judge.md). Only the worker process does this: an in-process worker (tests,
    benchmarks) leaves its host's collector alone.
    """
    await ready.wait()
    gc.collect()
    gc.freeze()


def cmd_publish(args: argparse.Namespace) -> int:
    from infra.jsonl import JsonlError
    from infra.kafka import MessageTooLarge
    from prm_pipeline.progress import progress_enabled, publish_progress
    from producers.publisher import TrajectoryPublisher

    cfg = _load(args)
    if getattr(args, "raw", False):
        return _publish_raw(cfg, args)
    publisher = TrajectoryPublisher(cfg.kafka, cfg.topics, experiment=experiment_of(args, cfg))

    async def main(on_progress: Any) -> dict[str, int]:
        async with publisher as pub:
            return await pub.publish_jsonl(args.file, on_progress=on_progress)

    try:
        with publish_progress(args.file, enabled=progress_enabled(args.quiet)) as on_progress:
            counts = asyncio.run(main(on_progress))
    except (JsonlError, MessageTooLarge, ValueError) as exc:  # one line, nothing sent: every line is checked first
        print(f"error: {exc}", file=sys.stderr)
        return 1
    streamed = f", {counts['turn']} turns and {counts['end']} session ends" if counts["turn"] or counts["end"] else ""
    print(
        f"published {counts['ready']} ready trajectories and {counts['discard']} discards{streamed} to "
        f"{publisher.topic}"
    )
    return 0


def _publish_raw(cfg: PipelineConfig, args: argparse.Namespace) -> int:
    """``publish --raw``: each non-empty line's bytes as one record, unchecked, without a key or
    headers — what a foreign producer that ignores docs/wire.md sends. Workers dead-letter what
    they cannot decode, so this is the way to make dead letters to try the tools on
    (docs/dead-letters.md)."""
    from infra.experiments import trajectories_topic
    from infra.kafka import make_producer

    topic = trajectories_topic(cfg.topics.trajectories, experiment_of(args, cfg))
    lines = [line for line in Path(args.file).read_bytes().splitlines() if line.strip()]

    async def send() -> None:
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            for line in lines:
                await producer.send(topic, line)
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(send())
    print(f"published {len(lines)} raw records (unchecked, no key, no headers) to {topic}")
    return 0


def cmd_verdicts(args: argparse.Namespace) -> int:
    from prm_pipeline.verdict_dump import dump_verdicts

    cfg = _load(args)
    return dump_verdicts(
        cfg,
        from_beginning=args.from_beginning,
        max_count=args.max,
        timeout_s=args.idle_timeout,
        out=args.out,
        since_ms=args.since,
        tokens=args.tokens,
        experiment=experiment_of(args, cfg),
    )


def cmd_trainer(args: argparse.Namespace) -> int:
    from shaper.trainer import cmd_trainer as run  # torch is imported only when training

    return run(args)


def _trainer_arguments(p: argparse.ArgumentParser) -> None:
    """``prm-pipeline trainer``'s flags (they live here so that other commands never import torch)."""
    p.add_argument(
        "--batch-groups",
        type=positive_int,
        default=None,
        metavar="N",
        help="accepted groups per batch (default: trainer.batch_groups)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="where batches and shaping live (default: trainer.device; auto = cuda if available)",
    )
    p.add_argument(
        "--mode",
        choices=list(SHAPING_MODES),
        default=None,
        help="advantage shaping mode (default: rollout.agent.prm.advantage_shaping.mode)",
    )
    p.add_argument("--max-steps", type=int, default=None, metavar="N", help="stop after N steps")
    p.add_argument(
        "--idle-timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="flush what is buffered and stop after S seconds without a new verdict",
    )
    p.add_argument(
        "--filter",
        default=None,
        metavar="NAME",
        help="group filter from shaper.filters.FILTERS (default: trainer.filter)",
    )
    p.add_argument(
        "--dedupe-store",
        default=None,
        metavar="PATH",
        help="sqlite file remembering acknowledged verdicts across restarts",
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="P",
        help="serve the consumer's counters as Prometheus /metrics on P (shaper/telemetry.py)",
    )
    p.add_argument(
        "--exclude-neutral-turns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="OpenClaw-RL exclusion: no loss on turns the judge scored 0 or without a next state, "
        "keeping one per session (default: trainer.exclude_neutral_turns)",
    )
    p.add_argument(
        "--combined-mode",
        choices=[*COMBINED_MODES, "none"],
        default=None,
        help="PRM + OPD token signal from the judge and OPD scorer channels; none = summed token "
        "rewards (default: trainer.combined_mode)",
    )
    add_experiment_option(
        p,
        "train on this experiment's verdicts (prm.verdicts.ID, consumer group "
        "<trainer.group_id>.ID; default: trainer.experiment)",
    )


def add_trainer_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``prm-pipeline trainer`` on ``subparsers`` (as :func:`build_parser` does)."""
    return add_command(subparsers, COMMANDS["trainer"])


# --------------------------------------------------------------------------- development commands
BENCHMARKS = (
    "schema",
    "runner",
    "shaping",
    "pipeline",
    "judge",
    "pool",
    "faults",
    "soak",
    "capacity",
    "sessions",
    "fleet",
    "ledger",
    "streaming",
)


def _source_checkout() -> Path | None:
    """The root of the source checkout this package runs from, or None when it is installed
    without one (the benchmarks in tests/perf are not part of the package)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "tests" / "perf").is_dir() else None


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark from tests/perf (needs a source checkout of the repository)."""
    root = _source_checkout()
    if root is None or not (root / "tests" / "perf" / f"bench_{args.name}.py").is_file():
        print(
            f"bench {args.name}: the benchmarks live in tests/perf of a source checkout of prm-pipeline, and "
            f"this installation ({Path(__file__).resolve().parent}) has none; clone the repository and run "
            "`prm-pipeline bench` from it",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module(f"tests.perf.bench_{args.name}")
    from prm_pipeline.progress import progress_enabled, spinner

    with spinner(f"bench {args.name}", enabled=progress_enabled(args.quiet)):
        return int(module.main(args.bench_args) or 0)


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no spinner (none either when stdout is not a terminal)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def _gateway_config(args: argparse.Namespace) -> PipelineConfig:
    """The config with ``--host`` / ``--port`` laid over ``gateway.host`` / ``gateway.port``."""
    import msgspec

    cfg = _load(args)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    return msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, **overrides)) if overrides else cfg


def cmd_gateway(args: argparse.Namespace) -> int:
    """The HTTP reward gateway (docs/integrations/gateway.md) until SIGINT/SIGTERM."""
    from prm_pipeline.gateway import serve

    cfg = _gateway_config(args)
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)

    async def main() -> None:
        stop = _stop_on_signals()
        await serve(
            cfg,
            stop,
            allow_unauthenticated=args.allow_unauthenticated,
            on_ready=lambda port: print(
                f"listening on http{'s' if cfg.gateway.tls_certfile else ''}://{cfg.gateway.host}:{port}", flush=True
            ),
        )

    event_loop.run(main())
    return 0


# --------------------------------------------------------------------------- the commands
def _up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--create-topics", action="store_true", help="also create the configured topics")


def _topics_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["create"])


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        metavar="N",
        help="records in flight (default worker.concurrency)",
    )
    p.add_argument("--worker-id", default=None, help="default: <hostname>-<pid>")
    p.add_argument("--metrics-port", type=port, default=None, metavar="P", help="serve Prometheus /metrics on P")


def _publish_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="JSONL file (docs/jsonl.md)")
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar (none either when stdout is not a terminal)"
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send each line's bytes unchecked as one record (no key, no headers): workers dead-letter "
        "what they cannot decode, a way to try the dead-letter tools (docs/dead-letters.md)",
    )
    add_experiment_option(
        p,
        "publish to this experiment's topic (prm.trajectories.ID), stamping experiment_id "
        "on lines that name none (default: trainer.experiment); it must be declared",
    )


def _verdicts_arguments(p: argparse.ArgumentParser) -> None:
    from prm_pipeline.verdict_dump import since_arg

    p.add_argument("--from-beginning", action="store_true", help="read the whole topic (default: only new verdicts)")
    p.add_argument("--max", type=int, default=None, metavar="N", help="stop after N verdicts")
    idle = p.add_argument(
        "--idle-timeout",
        type=seconds,
        default=None,
        metavar="S",
        help="stop after S seconds without a new verdict (default: wait until Ctrl-C or --max)",
    )
    deprecated_alias(p, "--timeout", idle)
    p.add_argument("--out", default=None, metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument(
        "--since",
        type=since_arg,
        metavar="TIME",
        default=None,
        help="only verdicts timestamped at/after TIME: ISO-8601 or an age like 15m, 2h, 1d",
    )
    p.add_argument(
        "--tokens",
        action="store_true",
        help="keep each member's token ids (interactions): the form `inspect --verdicts` reads",
    )
    add_experiment_option(p, "read this experiment's verdicts (prm.verdicts.ID; default: trainer.experiment)")


def _gateway_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="listen address (default gateway.host, 127.0.0.1)")
    p.add_argument("--port", type=port, default=None, help="listen port (default gateway.port; 0 = any free port)")
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen beyond loopback without bearer tokens (only behind a network policy)",
    )


# ---- checks of local inputs, run before waiting for any service (Command.checks)
def _check_event_loop(args: argparse.Namespace) -> None:
    event_loop.loop_factory()  # a bad PRM_EVENT_LOOP is a ConfigError now, not after waiting for Kafka


def _check_scorers(args: argparse.Namespace) -> None:
    """The configured scorers resolve and take their ``kwargs`` (building nothing): a typo, a
    missing package or a module outside ``worker.allowed_scorer_modules`` is a ConfigError at
    once, and so is a judge URL outside ``worker.allowed_judge_hosts``."""
    from scoring_workers.judge.hosts import check_config_judge_hosts
    from scoring_workers.prm.resolve import check_scorer_entries

    cfg = _load(args)
    if cfg.prm.active:
        try:
            check_scorer_entries(cfg.prm, allowed_prefixes=cfg.worker.allowed_scorer_modules)
        except (ImportError, TypeError) as exc:
            raise ConfigError(str(exc)) from None
        check_config_judge_hosts(cfg.prm, cfg.worker.allowed_judge_hosts)


def _check_gateway_exposure(args: argparse.Namespace) -> None:
    """Beyond loopback without bearer tokens or --allow-unauthenticated: refused before any connection."""
    from prm_pipeline.gateway import check_exposure, load_tokens

    gw = _gateway_config(args).gateway
    check_exposure(gw, authenticated=bool(load_tokens(gw)), allow_unauthenticated=args.allow_unauthenticated)


def _check_experiment_file(args: argparse.Namespace) -> None:
    if args.action == "add" and args.target:
        from prm_pipeline.experiment_tool import check_experiment_file

        check_experiment_file(_load(args), args.target)


def _check_jsonl(args: argparse.Namespace) -> None:
    if not getattr(args, "raw", False):
        from infra.jsonl import load

        for _ in load(args.file):  # every line is valid before anything connects
            pass


# ---- the topics a command reads or writes, which must exist before it builds a client (Command.topics)
def _trajectories(args: argparse.Namespace, cfg: PipelineConfig) -> list[str]:
    return [trajectories_topic(cfg.topics.trajectories, experiment_of(args, cfg))]


def _verdicts(args: argparse.Namespace, cfg: PipelineConfig) -> list[str]:
    return [verdicts_topic(cfg.topics.verdicts, experiment_of(args, cfg))]


def _experiment_topics(args: argparse.Namespace, cfg: PipelineConfig) -> list[str]:
    return _trajectories(args, cfg) + _verdicts(args, cfg)


def _worker_topics(args: argparse.Namespace, cfg: PipelineConfig) -> list[str]:
    """The default experiment's topics and the dead letters (declared experiments' topics
    are made by ``experiment add``, and a worker serves only those that exist)."""
    return [cfg.topics.trajectories, cfg.topics.verdicts, cfg.topics.dead_letters]


def _dead_letters_topic(args: argparse.Namespace, cfg: PipelineConfig) -> list[str]:
    return [cfg.topics.dead_letters]


def _inspected_verdicts(args: argparse.Namespace, cfg: PipelineConfig) -> list[str]:
    return _verdicts(args, cfg) if args.group and not args.verdicts else []


Arguments = Callable[[argparse.ArgumentParser], None]
Runner = Callable[[argparse.Namespace], int]
Topics = Callable[[argparse.Namespace, PipelineConfig], list[str]]


@dataclass(frozen=True)
class Command:
    """Everything the CLI knows about one command.

    ``arguments`` adds the command's flags; ``run`` runs it (each a function, or
    ``"module:function"`` imported only when needed). ``needs``: the services waited for
    before it starts (infra.startup). ``reads`` / ``writes``: files as (argparse dest, how
    the user spelt it) that must exist and be readable / whose folder must be writable,
    checked before the config is used and before any connection. ``checks``: further
    checks of local inputs, run before waiting for a service. ``experiment``: when it
    publishes to or waits on ``--experiment``, which must then be declared (``trainer`` and
    ``audit`` check theirs when they read its declaration, ``status`` in its own command,
    ``dead-letters`` when it filters by one); ``reads_removed``: the command only reads its
    topics, so a removed experiment is read too, with a note (docs/fleet.md). ``topics``: the
    topics it reads or writes, checked to exist (without having the broker create one) before it
    builds a producer or consumer, so a missing one is one line naming the fix at once.
    ``error_exit``: exit status of an error that is not the
    command's own verdict (``audit`` keeps 1 for "a group differs"). ``all_kafka_logs``: keep
    aiokafka's connection errors (long-running commands), instead of one line.
    ``development``: a development command, whose module is imported only when it runs.
    """

    name: str
    help: str
    run: Runner | str
    arguments: Arguments | str | None = None
    description: str | None = None
    needs: tuple[Service, ...] = ()
    reads: tuple[tuple[str, str], ...] = ()
    writes: tuple[tuple[str, str], ...] = ()
    checks: tuple[Callable[[argparse.Namespace], None], ...] = ()
    experiment: Callable[[argparse.Namespace], bool] | None = None
    reads_removed: bool = False  # it only reads the experiment's topics: a removed one is read, with a note
    topics: Topics | None = None
    error_exit: int = 1
    all_kafka_logs: bool = False
    development: bool = False
    parser: str | None = None  # "module:add_X_parser" of a development command that builds its own


def _resolve(ref: Any) -> Any:
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _always(args: argparse.Namespace) -> bool:
    return True


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("up", "run the embedded Kafka-protocol broker and Redis in the foreground", cmd_up, _up_arguments),
        Command("topics", "manage the configured topics", cmd_topics, _topics_arguments, needs=("kafka",)),
        Command(
            "worker",
            "run one scoring worker (run several for scale)",
            cmd_worker,
            _worker_arguments,
            needs=("kafka", "redis"),
            checks=(_check_event_loop, _check_scorers),
            topics=_worker_topics,
            all_kafka_logs=True,
        ),
        Command(
            "publish",
            "publish ready trajectories and discards from a JSONL file",
            cmd_publish,
            _publish_arguments,
            needs=("kafka",),
            reads=(("file", "FILE"),),
            checks=(_check_jsonl,),
            experiment=_always,
            topics=_trajectories,
        ),
        Command(
            "verdicts",
            "print verdicts as JSON lines",
            cmd_verdicts,
            _verdicts_arguments,
            needs=("kafka",),
            writes=(("out", "--out"),),
            experiment=_always,
            reads_removed=True,
            topics=_verdicts,
        ),
        Command(
            "trainer",
            "reference trainer loop: consume verdicts, build batches, shape advantages, print metrics",
            cmd_trainer,
            _trainer_arguments,
            description="Reference trainer loop over the verdicts topic (see docs/trainer.md).",
            needs=("kafka",),
            writes=(("dedupe_store", "--dedupe-store"),),
            checks=(_check_event_loop,),
            topics=_verdicts,
            all_kafka_logs=True,
        ),
        Command(
            "gateway",
            "HTTP reward service for OpenRLHF, slime and token-id clients",
            cmd_gateway,
            _gateway_arguments,
            needs=("kafka",),
            checks=(_check_event_loop, _check_gateway_exposure),
            topics=_experiment_topics,
        ),
        Command(
            "experiment",
            "declare, remove, forget or list experiments in the registry (docs/fleet.md)",
            "prm_pipeline.experiment_tool:checked_experiment",
            "prm_pipeline.experiment_tool:experiment_arguments",
            needs=("kafka",),
            checks=(_check_experiment_file,),
        ),
        Command(
            "dead-letters",
            "print dead letters with their headers decoded; --redrive republishes chosen ones",
            "prm_pipeline.dead_letter_tool:cmd_dead_letters",
            "prm_pipeline.dead_letter_tool:dead_letters_arguments",
            description="Read the dead-letter topic (JSON lines), or plan and run a redrive to the trajectories "
            "topic (a dry run unless --yes). See docs/dead-letters.md.",
            needs=("kafka",),
            writes=(("out", "--out"),),
            topics=_dead_letters_topic,
        ),
        Command(
            "audit",
            "re-score recorded trajectories and compare with the recorded verdicts",
            "prm_pipeline.audit.cli:cmd_audit",
            "prm_pipeline.audit.cli:audit_arguments",
            description="Re-score every trajectory a recorded verdict names with the configured scorers and "
            "compare. Reads prm.trajectories and prm.verdicts with group-less consumers (no offsets "
            "committed, no Redis). Exit code 1 when anything differs. See docs/audit.md.",
            needs=("kafka",),
            writes=(("out", "--out"),),
            checks=(_check_scorers,),
            topics=_experiment_topics,
            error_exit=2,
        ),
        Command(
            "fake-judge",
            "serve a scripted LLM judge / teacher on loopback (tests, benchmarks, demos)",
            "prm_pipeline.demo.fake_judge:cmd_fake_judge",
            development=True,
            parser="prm_pipeline.demo.fake_judge:add_fake_judge_parser",
        ),
        Command(
            "demo",
            "train a tiny LM through the pipeline (closed loop) and write a report",
            "prm_pipeline.demo.run:run_demo",
            "prm_pipeline.demo.run:add_demo_arguments",
            development=True,
        ),
        Command(
            "inspect",
            "token view of a verdict: output tokens coloured by process reward",
            "prm_pipeline.token_view:cmd_inspect",
            "prm_pipeline.token_view:inspect_arguments",
            reads=(("verdicts", "--verdicts"), ("audit", "--audit")),
            writes=(("html", "--html"),),
            experiment=lambda args: bool(args.group and not args.verdicts),
            reads_removed=True,
            topics=_inspected_verdicts,
        ),
        Command(
            "model-server",
            "serve the demo's tiny LM over SGLang /generate and OpenAI chat",
            "prm_pipeline.demo.model_server:cmd_model_server",
            development=True,
            parser="prm_pipeline.demo.model_server:add_model_server_parser",
        ),
        Command(
            "status",
            "is the pipeline healthy? lag, open groups, workers, verdict latency, dead letters",
            "prm_pipeline.status.command:cmd_status",
            "prm_pipeline.status.command:status_arguments",
            description="One screen of the pipeline's state. Exit code 0 when healthy, 1 when not (Kafka or Redis "
            "unreachable, no live worker, lag growing, the oldest open group past 80% of "
            "worker.group_timeout_s); warnings do not change it.",
        ),
        Command(
            "bench",
            f"run a benchmark from tests/perf of a source checkout ({', '.join(BENCHMARKS)})",
            cmd_bench,
            _bench_arguments,
            development=True,
        ),
    )
}


# --------------------------------------------------------------------------- parser
def _runner(command: Command) -> Runner:
    def run(args: argparse.Namespace) -> int:
        return int(_resolve(command.run)(args) or 0)

    run.__name__ = f"run_{command.name.replace('-', '_')}"
    return run


def _build(subparsers: Any, command: Command) -> argparse.ArgumentParser:
    if command.parser is not None:  # a development command that registers itself
        p = _resolve(command.parser)(subparsers)
    else:
        p = subparsers.add_parser(command.name, help=command.help, description=command.description or None)
        if command.arguments is not None:
            _resolve(command.arguments)(p)
    p.set_defaults(func=_runner(command))
    return p


class _DeferredParser(argparse.ArgumentParser):
    """A development command's parser, built from its module when the command is used
    (parsed or its ``--help`` shown), so that listing the commands imports none of them."""

    def __init__(self, command: Command, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.command = command
        self._real: argparse.ArgumentParser | None = None

    def real(self) -> argparse.ArgumentParser:
        if self._real is None:
            scratch = argparse.ArgumentParser(prog=self.prog.rsplit(" ", 1)[0])
            sub = scratch.add_subparsers()
            self._real = _build(sub, self.command)
            _add_global_options(self._real)
        return self._real

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        return self.real().parse_known_args(args, namespace)

    def format_help(self) -> str:
        return self.real().format_help()

    def format_usage(self) -> str:
        return self.real().format_usage()


def add_command(subparsers: Any, command: Command) -> argparse.ArgumentParser:
    """Register ``command`` on an argparse subparsers object (development ones deferred)."""
    if not command.development or command.arguments is not None and not isinstance(command.arguments, str):
        return _build(subparsers, command)
    parser_class = subparsers._parser_class
    subparsers._parser_class = lambda **kw: _DeferredParser(command, **kw)
    try:
        return subparsers.add_parser(command.name, help=command.help)
    finally:
        subparsers._parser_class = parser_class


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The full parser of command ``name`` in ``parser`` (building a deferred one)."""
    p = _subparsers(parser).choices[name]
    return p.real() if isinstance(p, _DeferredParser) else p


class _Parser(argparse.ArgumentParser):
    """The top-level parser: a mistyped flag is named with its closest match, and in the
    usage of the command it was given to (argparse reports it in the top-level usage, and an
    unknown option before the command as "invalid choice" of the word after it)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        sub = _subparsers(self)
        for word in argv:  # the options before the command
            if word in sub.choices or word == "--":
                break
            if word.startswith("-") and not self._option_known(word):
                self.error(f"unrecognized option {word.split('=', 1)[0]}{_did_you_mean(word, self)}")
        parsed, extras = super().parse_known_args(argv, namespace)
        if extras:
            target = command_parser(self, parsed.command) if getattr(parsed, "command", None) in sub.choices else self
            flags = [w for w in extras if w.startswith("-")]
            hints = "".join(_did_you_mean(w, target) for w in flags)
            target.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        return parsed, []

    def _option_known(self, word: str) -> bool:
        """A top-level option as argparse reads it: whole, abbreviated (``--conf``) or, for a
        short one, with its value or other short flags attached (``-vv``)."""
        name = word.split("=", 1)[0]
        options = [s for a in self._actions for s in a.option_strings]
        if not name.startswith("--"):
            return name[:2] in options
        return name in options or (self.allow_abbrev and any(o.startswith(name) for o in options))


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _did_you_mean(word: str, parser: argparse.ArgumentParser) -> str:
    """``" (did you mean --x?)"`` for a mistyped flag of ``parser``, or "" when none is close."""
    import difflib

    options = [
        s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")
    ]
    match = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.7)
    return f" (did you mean {match[0]}?)" if match else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prm-pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config file (default: $PRM_CONFIG or built-in defaults)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)
    for command in COMMANDS.values():
        add_command(sub, command)
    for p in sub.choices.values():
        if not isinstance(p, _DeferredParser):
            _add_global_options(p)
    return parser


def _add_global_options(p: argparse.ArgumentParser) -> None:
    """``prm-pipeline worker --config x.yaml`` works like ``prm-pipeline --config x.yaml worker``.

    Each subcommand repeats the global options with ``default=SUPPRESS``: given after the
    subcommand they override the global value, absent they leave it alone.
    """
    known = {s for action in p._actions for s in action.option_strings}
    if "--config" not in known:
        p.add_argument(
            "--config",
            default=argparse.SUPPRESS,
            help="YAML config file (also accepted before the subcommand; default: $PRM_CONFIG)",
        )
    if "--verbose" not in known and "-v" not in known:
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")


def local_file_problem(args: argparse.Namespace) -> str | None:
    """One line naming the first input that cannot be read or output that cannot be written."""
    command = COMMANDS[args.command]
    for dest, flag in command.reads:
        path = getattr(args, dest, None)
        if path is None:
            continue
        p = Path(path)
        if not p.exists():
            return f"{args.command} {flag}: {path!r} does not exist"
        if p.is_dir():
            return f"{args.command} {flag}: {path!r} is a folder, not a file"
        if not os.access(p, os.R_OK):
            return f"{args.command} {flag}: {path!r} is not readable"
    for dest, flag in command.writes:
        path = getattr(args, dest, None)
        if path is None:
            continue
        p = Path(path)
        folder = p.parent
        if p.is_dir():
            return f"{args.command} {flag}: {path!r} is a folder, not a file"
        if not folder.is_dir():
            return f"{args.command} {flag}: cannot write {path!r}: folder {str(folder)!r} does not exist"
        if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
            return f"{args.command} {flag}: cannot write {path!r}: permission denied"
    return None


def preflight(args: argparse.Namespace) -> None:
    """The command's checks of local inputs (:attr:`Command.checks`), which need no service."""
    for check in COMMANDS[args.command].checks:
        check(args)


def _experiment_to_check(args: argparse.Namespace) -> str | None:
    """The experiment the command publishes to or waits on, which must be declared
    (:func:`infra.registry.declared_experiment`); None when it does neither."""
    when = COMMANDS[args.command].experiment
    return experiment_of(args, _load(args)) if when is not None and when(args) else None


def _require_topics(args: argparse.Namespace, topics: list[str]) -> None:
    """The command's topics exist, else :class:`~infra.kafka.TopicMissing` (one line with the
    fix). An experiment's topic is missing when the experiment was never declared: then
    that is the line (``trainer`` and ``audit`` check their declaration only later)."""
    from infra.kafka import TopicMissing

    cfg = _load(args)
    try:
        asyncio.run(require_topics(cfg.kafka, topics))
    except TopicMissing as exc:
        if exc.topic not in (cfg.topics.trajectories, cfg.topics.verdicts, cfg.topics.dead_letters):
            asyncio.run(declared_experiment(cfg, experiment_of(args, cfg)))  # UnknownExperiment: exit 2
        raise


def _access_error(args: argparse.Namespace, exc: BaseException) -> str | None:
    """One line for a refused Kafka or Redis connection (TLS trust, login, wrong protocol)."""
    from aiokafka.errors import KafkaConnectionError

    from infra.kafka import KafkaAccessRefused, diagnose_connection
    from infra.redis import RedisAccessError, access_refusal

    if isinstance(exc, (KafkaAccessRefused, RedisAccessError)):
        return str(exc)
    if (refused := access_refusal(exc, _load(args).redis)) is not None:  # e.g. an ACL without a ledger command
        return str(refused)
    if isinstance(exc, KafkaConnectionError):
        return str(asyncio.run(diagnose_connection(_load(args).kafka)))
    return None


class _QuietBootstrapErrors(logging.Filter):
    """aiokafka logs each failed bootstrap connect at ERROR before raising; one-shot commands
    print one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Unable connect to", "Unable to request metadata"))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(logging.DEBUG if args.verbose else logging.WARNING)
    command = COMMANDS[args.command]
    if not args.verbose and not command.all_kafka_logs:
        logging.getLogger("aiokafka").addFilter(_QuietBootstrapErrors())
    failed = command.error_exit
    if (problem := local_file_problem(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        preflight(args)
        if command.needs:
            try:
                asyncio.run(wait_for_services(_load(args), command.needs))
            except ServiceUnavailable as exc:
                print(f"error: {printable(str(exc))}", file=sys.stderr)
                return failed
        if (experiment := _experiment_to_check(args)) is not None:
            if command.reads_removed:
                if (recorded := asyncio.run(recorded_experiment(_load(args), experiment))).removed:
                    print(removed_note(_load(args), recorded), file=sys.stderr)
            else:
                asyncio.run(declared_experiment(_load(args), experiment))
        if command.topics is not None and (topics := command.topics(args, _load(args))):
            _require_topics(args, topics)
        return int(args.func(args) or 0)
    except UnknownExperiment as exc:  # nothing would ever read what the command publishes or waits for
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"config error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:
        from infra.jsonl import JsonlError
        from infra.kafka import TopicCreationFailed, TopicMissing

        if isinstance(exc, (JsonlError, TopicMissing, TopicCreationFailed)):
            print(f"error: {printable(str(exc))}", file=sys.stderr)
            return failed
        message = _access_error(args, exc)
        if message is None:
            if failed == 1:
                raise
            traceback.print_exc()
            return failed
        print(f"error: {printable(message)}", file=sys.stderr)
        return failed
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
