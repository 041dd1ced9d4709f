"""prm-pipeline: one command line for every part of the pipeline.

Each subcommand reads ``--config FILE`` (or ``$PRM_CONFIG``) plus ``PRM_*`` environment
overrides through :func:`infra.config.load_config`.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra import event_loop
from infra.config import COMBINED_MODES, SHAPING_MODES, ConfigError, PipelineConfig, load_config
from infra.experiments import UnknownExperiment, declared_experiment
from infra.startup import Service, ServiceUnavailable, wait_for_services
from prm_pipeline.experiment_option import add_experiment_option, experiment_of

log = logging.getLogger("prm_pipeline")


def _load(args: argparse.Namespace) -> PipelineConfig:
    return load_config(args.config)


def positive_int(text: str) -> int:
    """argparse type for counts that override a config key constrained to >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


# --------------------------------------------------------------------------- up / topics
def cmd_up(args: argparse.Namespace) -> int:
    """Run the embedded broker + Redis in the foreground until SIGINT/SIGTERM."""
    from infra.local import LOCAL_BROKER_ENV, LocalStack
    from prm_pipeline.foreground import StopSignals

    cfg = _load(args)
    with StopSignals() as stop, LocalStack(cfg.local.data_dir, broker_binary=cfg.local.broker_binary,
                                           redis_binary=cfg.local.redis_binary) as stack:
        if args.create_topics:
            import msgspec

            from infra.kafka import ensure_topics

            kafka = msgspec.structs.replace(cfg.kafka, bootstrap=stack.kafka_bootstrap)
            asyncio.run(ensure_topics(kafka, cfg.topics))
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
    from infra.kafka import ensure_topics
    from infra.registry import read_registry

    cfg = _load(args)

    async def create() -> dict[str, str]:
        result = await ensure_topics(cfg.kafka, cfg.topics)
        declared = [e for e, entry in sorted((await read_registry(cfg)).items()) if entry.spec is not None]
        names = [t for e in declared for t in (trajectories_topic(cfg.topics.trajectories, e),
                                               verdicts_topic(cfg.topics.verdicts, e))]
        if names:
            result.update(await ensure_topics(cfg.kafka, cfg.topics, names))
        return result

    for name, state in asyncio.run(create()).items():
        print(f"{state:8} {name}")
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
    print(f"published {counts['ready']} ready trajectories and {counts['discard']} discards to {publisher.topic}")
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
    return dump_verdicts(cfg, from_beginning=args.from_beginning, max_count=args.max,
                         timeout_s=args.timeout, out=args.out, since_ms=args.since, tokens=args.tokens,
                         experiment=experiment_of(args, cfg))


def cmd_trainer(args: argparse.Namespace) -> int:
    from shaper.trainer import cmd_trainer as run  # torch is imported only when training

    return run(args)


def add_trainer_parser(subparsers: Any) -> None:
    """``prm-pipeline trainer`` (its options live here so that other commands never import torch)."""
    p = subparsers.add_parser(
        "trainer",
        help="reference trainer loop: consume verdicts, build batches, shape advantages, print metrics",
        description="Reference trainer loop over the verdicts topic (see docs/trainer.md).",
    )
    p.add_argument("--batch-groups", type=positive_int, default=None, metavar="N",
                   help="accepted groups per batch (default: trainer.batch_groups)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help="where batches and shaping live (default: trainer.device; auto = cuda if available)")
    p.add_argument("--mode", choices=list(SHAPING_MODES), default=None,
                   help="advantage shaping mode (default: rollout.agent.prm.advantage_shaping.mode)")
    p.add_argument("--max-steps", type=int, default=None, metavar="N", help="stop after N steps")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                   help="flush what is buffered and stop after S seconds without a verdict")
    p.add_argument("--filter", default=None, metavar="NAME",
                   help="group filter from shaper.filters.FILTERS (default: trainer.filter)")
    p.add_argument("--dedupe-store", default=None, metavar="PATH",
                   help="sqlite file remembering acknowledged verdicts across restarts")
    p.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help="serve the consumer's counters as Prometheus /metrics on P (shaper/telemetry.py)")
    p.add_argument("--exclude-neutral-turns", action=argparse.BooleanOptionalAction, default=None,
                   help="OpenClaw-RL exclusion: no loss on turns the judge scored 0 or without a next state, "
                        "keeping one per session (default: trainer.exclude_neutral_turns)")
    p.add_argument("--combined-mode", choices=[*COMBINED_MODES, "none"], default=None,
                   help="PRM + OPD token signal from the judge and OPD scorer channels; none = summed token "
                        "rewards (default: trainer.combined_mode)")
    add_experiment_option(p, "train on this experiment's verdicts (prm.verdicts.ID, consumer group "
                             "<trainer.group_id>.ID; default: trainer.experiment)")
    p.set_defaults(func=cmd_trainer)




# --------------------------------------------------------------------------- demo / bench
def cmd_demo(args: argparse.Namespace) -> int:
    from prm_pipeline.demo.run import run_demo

    return run_demo(args)


BENCHMARKS = ("schema", "runner", "shaping", "pipeline", "judge", "pool", "faults", "soak", "capacity", "sessions",
              "fleet", "ledger")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark from tests/perf (needs a checkout of the repository)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(f"tests.perf.bench_{args.name}")
    except ModuleNotFoundError as exc:
        print(f"benchmark {args.name!r} not found ({exc}); run from a checkout of prm-pipeline", file=sys.stderr)
        return 2
    from prm_pipeline.progress import progress_enabled, spinner

    with spinner(f"bench {args.name}", enabled=progress_enabled(args.quiet)):
        return int(module.main(args.bench_args) or 0)


def cmd_gateway(args: argparse.Namespace) -> int:
    """The HTTP reward gateway (docs/integrations/gateway.md) until SIGINT/SIGTERM."""
    import msgspec

    from prm_pipeline.gateway import serve

    cfg = _load(args)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        cfg = msgspec.structs.replace(cfg, gateway=msgspec.structs.replace(cfg.gateway, **overrides))
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)

    async def main() -> None:
        stop = _stop_on_signals()
        await serve(cfg, stop, allow_unauthenticated=args.allow_unauthenticated,
                    on_ready=lambda port: print(f"listening on http{'s' if cfg.gateway.tls_certfile else ''}://"
                                                f"{cfg.gateway.host}:{port}", flush=True))

    event_loop.run(main())
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from prm_pipeline.verdict_dump import since_arg

    parser = argparse.ArgumentParser(prog="prm-pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config file (default: $PRM_CONFIG or built-in defaults)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="run the embedded Kafka-protocol broker and Redis in the foreground")
    p.add_argument("--create-topics", action="store_true", help="also create the configured topics")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("topics", help="manage the configured topics")
    p.add_argument("action", choices=["create"])
    p.set_defaults(func=cmd_topics)

    p = sub.add_parser("worker", help="run one scoring worker (run several for scale)")
    p.add_argument("--concurrency", type=positive_int, default=None, help="records in flight (default worker.concurrency)")
    p.add_argument("--worker-id", default=None, help="default: <hostname>-<pid>")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("publish", help="publish ready trajectories and discards from a JSONL file")
    p.add_argument("file", help="JSONL file (docs/jsonl.md)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (none either when stdout is not a terminal)")
    p.add_argument("--raw", action="store_true",
                   help="send each line's bytes unchecked as one record (no key, no headers): workers dead-letter "
                        "what they cannot decode, a way to try the dead-letter tools (docs/dead-letters.md)")
    add_experiment_option(p, "publish to this experiment's topic (prm.trajectories.ID), stamping experiment_id "
                             "on lines that name none (default: trainer.experiment); it must be declared")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("verdicts", help="print verdicts as JSON lines")
    p.add_argument("--from-beginning", action="store_true", help="read the whole topic (default: only new verdicts)")
    p.add_argument("--max", type=int, default=None, help="stop after N verdicts")
    p.add_argument("--timeout", type=float, default=None, help="stop after S seconds without a new verdict")
    p.add_argument("--out", default=None, help="write to FILE instead of stdout")
    p.add_argument("--since", type=since_arg, metavar="TIME", default=None,
                   help="only verdicts timestamped at/after TIME: ISO-8601 or an age like 15m, 2h, 1d")
    p.add_argument("--tokens", action="store_true",
                   help="keep each member's token ids (interactions): the form `inspect --verdicts` reads")
    add_experiment_option(p, "read this experiment's verdicts (prm.verdicts.ID; default: trainer.experiment)")
    p.set_defaults(func=cmd_verdicts)

    add_trainer_parser(sub)

    p = sub.add_parser("gateway", help="HTTP reward service for OpenRLHF, slime and token-id clients")
    p.add_argument("--host", default=None, help="listen address (default gateway.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default gateway.port; 0 = any free port)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="listen beyond loopback without bearer tokens (only behind a network policy)")
    p.set_defaults(func=cmd_gateway)

    from prm_pipeline.audit import add_audit_parser
    from prm_pipeline.dead_letter_tool import add_dead_letters_parser
    from prm_pipeline.demo.fake_judge import add_fake_judge_parser
    from prm_pipeline.experiment_tool import add_experiment_parser

    add_experiment_parser(sub)
    add_dead_letters_parser(sub)
    add_audit_parser(sub)
    add_fake_judge_parser(sub)

    p = sub.add_parser("demo", help="train a tiny LM through the pipeline (closed loop) and write a report")
    from prm_pipeline.demo.run import add_demo_arguments

    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)

    from prm_pipeline.demo.model_server import add_model_server_parser
    from prm_pipeline.token_view import add_inspect_parser

    add_inspect_parser(sub)
    add_model_server_parser(sub)

    from prm_pipeline.status.command import add_status_parser

    add_status_parser(sub)

    p = sub.add_parser("bench", help=f"run a benchmark from tests/perf ({', '.join(BENCHMARKS)})")
    p.add_argument("-q", "--quiet", action="store_true", help="no spinner (none either when stdout is not a terminal)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=cmd_bench)
    _accept_global_options_after(sub)
    return parser


def _accept_global_options_after(sub: argparse._SubParsersAction) -> None:
    """``prm-pipeline worker --config x.yaml`` works like ``prm-pipeline --config x.yaml worker``.

    Each subcommand repeats the global options with ``default=SUPPRESS``: given after the
    subcommand they override the global value, absent they leave it alone.
    """
    for p in sub.choices.values():
        known = {s for action in p._actions for s in action.option_strings}
        if "--config" not in known:
            p.add_argument("--config", default=argparse.SUPPRESS,
                           help="YAML config file (also accepted before the subcommand; default: $PRM_CONFIG)")
        if "--verbose" not in known and "-v" not in known:
            p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")


# The services each command needs before it starts (infra.startup waits for them).
NEEDS: dict[str, tuple[Service, ...]] = {
    "topics": ("kafka",), "worker": ("kafka", "redis"), "publish": ("kafka",),
    "verdicts": ("kafka",), "trainer": ("kafka",), "audit": ("kafka",), "dead-letters": ("kafka",),
    "gateway": ("kafka",), "experiment": ("kafka",),
}

# Files each command reads (they must exist and be readable) and writes (their folder must
# exist and be writable), as (argparse dest, how the user spelt it). They are checked before
# the config is used and before any connection: a mistyped path is one line at once, not a
# wait of kafka.startup_timeout_s followed by a message about Kafka. A new command that
# takes a file adds it here.
READS: dict[str, tuple[tuple[str, str], ...]] = {
    "publish": (("file", "FILE"),),
    "inspect": (("verdicts", "--verdicts"), ("audit", "--audit")),
}
WRITES: dict[str, tuple[tuple[str, str], ...]] = {
    "verdicts": (("out", "--out"),),
    "audit": (("out", "--out"),),
    "inspect": (("html", "--html"),),
    "trainer": (("dedupe_store", "--dedupe-store"),),
}


def _experiment_to_check(args: argparse.Namespace) -> str | None:
    """The experiment a command publishes to or waits on, which must be declared
    (:func:`infra.experiments.declared_experiment`); None when the command does neither.
    ``trainer`` and ``audit`` check theirs when they read its declaration; ``status``
    checks in its own command (it reports an unreachable Kafka itself); ``dead-letters``
    checks none (its letters may name an undeclared experiment)."""
    if args.command in ("publish", "verdicts") or (args.command == "inspect" and args.group and not args.verdicts):
        return experiment_of(args, _load(args))
    return None


# Exit status of an error that is not the command's own verdict. ``audit`` keeps 1 for
# "a group differs", so its errors (config, files, services, crashes) exit 2.
ERROR_EXIT: dict[str, int] = {"audit": 2}


def local_file_problem(args: argparse.Namespace) -> str | None:
    """One line naming the first input that cannot be read or output that cannot be written."""
    for dest, flag in READS.get(args.command, ()):
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
    for dest, flag in WRITES.get(args.command, ()):
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


LONG_RUNNING = ("worker", "trainer", "gateway")  # they run on infra.event_loop's loop


def preflight(args: argparse.Namespace) -> None:
    """Checks of local inputs that need no service, run before waiting for any.

    ``worker`` and ``audit`` resolve the configured scorers and check their ``kwargs``
    (building nothing): a typo, a missing package or a module outside
    ``worker.allowed_scorer_modules`` is a :class:`ConfigError` at once, and so is a judge
    URL outside ``worker.allowed_judge_hosts``. ``publish`` validates its whole file.
    The long-running commands check ``PRM_EVENT_LOOP`` (:mod:`infra.event_loop`).
    """
    if args.command in LONG_RUNNING:
        event_loop.loop_factory()  # a bad PRM_EVENT_LOOP is a ConfigError now, not after waiting for Kafka
    if args.command in ("worker", "audit"):
        from scoring_workers.judge.hosts import check_config_judge_hosts
        from scoring_workers.prm.resolve import check_scorer_entries

        cfg = _load(args)
        if cfg.prm.active:
            try:
                check_scorer_entries(cfg.prm, allowed_prefixes=cfg.worker.allowed_scorer_modules)
            except (ImportError, TypeError) as exc:
                raise ConfigError(str(exc)) from None
            check_config_judge_hosts(cfg.prm, cfg.worker.allowed_judge_hosts)
    elif args.command == "experiment" and args.action == "add" and args.target:
        from prm_pipeline.experiment_tool import check_experiment_file

        check_experiment_file(_load(args), args.target)
    elif args.command == "publish" and not getattr(args, "raw", False):
        from infra.jsonl import load

        for _ in load(args.file):  # every line is valid before anything connects
            pass
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
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose and args.command not in ("worker", "trainer"):  # long-running: keep every line
        logging.getLogger("aiokafka").addFilter(_QuietBootstrapErrors())
    failed = ERROR_EXIT.get(args.command, 1)
    if (problem := local_file_problem(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        preflight(args)
        if args.command in NEEDS:
            try:
                asyncio.run(wait_for_services(_load(args), NEEDS[args.command]))
            except ServiceUnavailable as exc:
                print(f"error: {exc}", file=sys.stderr)
                return failed
        if (experiment := _experiment_to_check(args)) is not None:
            asyncio.run(declared_experiment(_load(args), experiment))
        return int(args.func(args) or 0)
    except UnknownExperiment as exc:  # nothing would ever read what the command publishes or waits for
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from infra.jsonl import JsonlError
        from infra.kafka import TopicMissing

        if isinstance(exc, (JsonlError, TopicMissing)):
            print(f"error: {exc}", file=sys.stderr)
            return failed
        message = _access_error(args, exc)
        if message is None:
            if failed == 1:
                raise
            traceback.print_exc()
            return failed
        print(f"error: {message}", file=sys.stderr)
        return failed
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
