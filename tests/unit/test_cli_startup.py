"""Starting a command without its services, or with a missing config: one line, no traceback.

The CLI runs as a subprocess against closed loopback ports with a short
``startup_timeout_s`` (under a second), as a newcomer who forgot ``prm-pipeline up`` would run it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infra.startup import ServiceUnavailable, redis_address, wait_until_reachable
from prm_pipeline.cli import build_parser


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PRM_")}
    base.update({"PRM_KAFKA_STARTUP_TIMEOUT_S": "0.8", "PRM_REDIS_STARTUP_TIMEOUT_S": "0.8"})
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", *args], capture_output=True, text=True, timeout=60, env=base, cwd=cwd
    )


def _assert_one_line_report(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Unclosed" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "config error:"))]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.mark.slow  # the CLI as a child process
@pytest.mark.parametrize("command", [["topics", "create"], ["worker"]])  # one of each set of needs (Command.needs)
def test_command_without_kafka_waits_then_names_address_and_setting(command: list[str]) -> None:
    port = _closed_port()
    proc = _run(
        *command,
        env={"PRM_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}", "PRM_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0"},
    )
    line = _assert_one_line_report(proc, "Kafka", f"127.0.0.1:{port}", "PRM_KAFKA_BOOTSTRAP", "`prm-pipeline up`")
    assert proc.returncode == 1, line
    # retried with a log line per attempt before giving up
    assert "not reachable (attempt 1" in proc.stderr and "not reachable (attempt 2" in proc.stderr, proc.stderr


@pytest.mark.slow  # the CLI as a child process
def test_missing_config_file_is_one_line_before_or_after_the_subcommand(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    for args, env in (
        (["--config", str(missing), "worker"], None),
        (["worker", "--config", str(missing)], None),
        (["worker"], {"PRM_CONFIG": str(missing)}),
    ):
        proc = _run(*args, env=env)
        _assert_one_line_report(proc, str(missing), "does not exist")
        assert proc.returncode == 2


@pytest.mark.slow  # the CLI as a child process
def test_config_is_read_before_or_after_the_subcommand_and_from_prm_config(tmp_path: Path) -> None:
    """The file's own broker address shows up in the report, so the file was really read."""
    port = _closed_port()
    config = tmp_path / "c.yaml"
    config.write_text(f"kafka:\n  bootstrap: 127.0.0.1:{port}\n  startup_timeout_s: 0.5\n")
    for args, env in (
        (["--config", str(config), "topics", "create"], None),
        (["topics", "create", "--config", str(config)], None),
        (["topics", "create"], {"PRM_CONFIG": str(config)}),
    ):
        proc = _run(*args, env={**(env or {}), "PRM_KAFKA_STARTUP_TIMEOUT_S": "0.5"})
        _assert_one_line_report(proc, f"127.0.0.1:{port}")


def test_config_after_the_subcommand_overrides_the_one_before() -> None:
    parser = build_parser()
    assert parser.parse_args(["worker", "--config", "a.yaml"]).config == "a.yaml"
    assert parser.parse_args(["--config", "a.yaml", "worker"]).config == "a.yaml"
    assert parser.parse_args(["--config", "a.yaml", "trainer", "--config", "b.yaml"]).config == "b.yaml"
    assert parser.parse_args(["audit", "-v"]).verbose is True
    assert parser.parse_args(["verdicts"]).config is None


def test_redis_address_hides_credentials() -> None:
    from infra.config import RedisConfig

    assert redis_address(RedisConfig(url="redis://user:s3cret@cache:6380/2")) == "redis://cache:6380/2"
    address = redis_address(RedisConfig(url="rediss://:s3cret@h/0"))
    assert "s3cret" not in str(ServiceUnavailable("Redis", address, "PRM_REDIS_URL", "x", 1))


async def test_wait_retries_with_a_log_line_per_attempt_until_the_service_answers(caplog) -> None:
    calls = []

    async def probe(timeout_s: float) -> None:
        calls.append(timeout_s)
        if len(calls) < 3:
            raise ConnectionRefusedError("connection refused")

    with caplog.at_level(logging.WARNING, logger="infra.startup"):
        await wait_until_reachable(probe, what="Redis", address="redis://h:1/0", setting="PRM_REDIS_URL", timeout_s=10)
    assert len(calls) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert [("attempt 1" in m, "attempt 2" in m) for m in lines[:2]] == [(True, False), (False, True)]
    assert "reachable (attempt 3)" in lines[-1]


async def test_wait_gives_up_after_the_timeout() -> None:
    async def probe(timeout_s: float) -> None:
        raise ConnectionRefusedError("connection refused")

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ServiceUnavailable, match=r"cannot reach Kafka at h:9 after 1 s \(connection refused\)"):
        await wait_until_reachable(probe, what="Kafka", address="h:9", setting="PRM_KAFKA_BOOTSTRAP", timeout_s=1.0)
    assert 0.9 <= loop.time() - t0 < 5


def test_a_redis_acl_refusal_is_one_line_and_other_redis_errors_are_not_hidden() -> None:
    from redis.exceptions import ResponseError

    from infra.config import RedisConfig
    from infra.redis import RedisAccessError, access_refusal

    cfg = RedisConfig(url="redis://prm-worker:s3cret@10.0.0.5:6380/0")
    refused = access_refusal(
        ResponseError("ACL failure in script: User prm-worker has no permissions to run the 'sismember' command"), cfg
    )
    assert isinstance(refused, RedisAccessError)
    assert "10.0.0.5:6380 as user 'prm-worker'" in str(refused) and "docs/deploy.md" in str(refused)
    assert "s3cret" not in str(refused)
    assert access_refusal(ResponseError("ERR Error running script: attempt to compare nil"), cfg) is None


async def test_the_worker_process_freezes_what_start_up_built_once_ready() -> None:
    import asyncio
    import gc

    from prm_pipeline.cli import _freeze_gc_when_ready

    ready = asyncio.Event()
    task = asyncio.create_task(_freeze_gc_when_ready(ready))
    await asyncio.sleep(0)
    assert gc.get_freeze_count() == 0 and not task.done()  # nothing before the worker is ready
    ready.set()
    try:
        await asyncio.wait_for(task, 10)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


# --------------------------------------------------------------------------- local inputs before services
_SCORER_CONFIG = """\
rollout:
  agent:
    prm:
      scorers:
        - path: {path}
          {entry}
          kwargs: {kwargs}
actor:
  token_rewards_as_adv: true
worker:
  allowed_scorer_modules: [scoring_workers.scorers, no_such_pkg_q7]
"""


@pytest.mark.slow  # the CLI as a child process
@pytest.mark.parametrize(
    ("command", "path", "entry", "kwargs", "needles"),
    [
        (
            "worker",
            "examples.prm.scorers.LengthBudgetScorer",
            "wieght: 0.5",
            "{}",
            ("rollout.agent.prm.scorers[0]: unknown key `wieght`; did you mean `weight`?",),
        ),
        (
            "worker",
            "examples.prm.scorers.LengthBudgetScorer",
            "enabled: true",
            "{max_output_token: 64}",
            ("rollout.agent.prm.scorers[0]", "`max_output_token`; did you mean `max_output_tokens`?"),
        ),
        (
            "worker",
            "no_such_pkg_q7.scorers.Mine",
            "weight: 1.0",
            "{}",
            ("'no_such_pkg_q7.scorers' is not importable", "install the package", "PYTHONPATH"),
        ),
        (
            "audit",
            "examples.prm.scorers.LengthBudgetScorer",
            "enabled: true",
            "{max_output_token: 64}",
            ("did you mean `max_output_tokens`?",),
        ),  # audit: 2, its 1 means "a group differs"
    ],
)
def test_config_and_scorer_mistakes_are_one_line_exit_2_before_any_connection(
    tmp_path: Path, command: str, path: str, entry: str, kwargs: str, needles: tuple[str, ...]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(_SCORER_CONFIG.format(path=path, entry=entry, kwargs=kwargs))
    proc = _run(
        "--config",
        str(config),
        command,
        env={
            "PRM_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}",
            "PRM_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0",
        },
    )
    line = _assert_one_line_report(proc, *needles)
    assert proc.returncode == 2, proc.stderr
    assert line.startswith("config error:") and "not reachable" not in proc.stderr  # never waited for Kafka


@pytest.mark.slow  # the CLI as a child process
def test_publish_of_a_missing_file_exits_2_at_once_naming_it(tmp_path: Path) -> None:
    """Before: it waited kafka.startup_timeout_s for a broker, then talked about Kafka."""
    proc = _run(
        "publish",
        "missing.jsonl",
        cwd=tmp_path,
        env={"PRM_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}", "PRM_KAFKA_STARTUP_TIMEOUT_S": "600"},
    )
    line = _assert_one_line_report(proc, "'missing.jsonl' does not exist")
    assert proc.returncode == 2 and line == "error: publish FILE: 'missing.jsonl' does not exist"
    assert "Kafka" not in proc.stderr


def test_every_file_a_command_takes_is_checked_before_it_connects(tmp_path: Path) -> None:
    from prm_pipeline.cli import local_file_problem

    parser = build_parser()
    here = tmp_path / "here.jsonl"
    here.write_text("")
    gone, nowhere = str(tmp_path / "gone.jsonl"), str(tmp_path / "no-dir" / "x")

    def problem(*argv: str) -> str | None:
        return local_file_problem(parser.parse_args(list(argv)))

    assert problem("publish", gone) == f"publish FILE: {gone!r} does not exist"
    assert problem("publish", str(tmp_path)) == f"publish FILE: {str(tmp_path)!r} is a folder, not a file"
    assert problem("inspect", "--verdicts", gone) == f"inspect --verdicts: {gone!r} does not exist"
    assert problem("inspect", "--verdicts", str(here), "--audit", gone) == f"inspect --audit: {gone!r} does not exist"
    for argv in (
        ("verdicts", "--out", nowhere),
        ("audit", "--out", nowhere),
        ("inspect", "--group", "g", "--html", nowhere),
        ("trainer", "--dedupe-store", nowhere),
    ):
        assert problem(*argv) == (
            f"{argv[0]} {argv[-2]}: cannot write {nowhere!r}: folder {str(tmp_path / 'no-dir')!r} does not exist"
        )
    assert problem("publish", str(here)) is None and problem("verdicts", "--out", str(tmp_path / "v.jsonl")) is None
    assert problem("worker") is None


@pytest.mark.slow  # the CLI as a child process
def test_audit_without_kafka_exits_2_not_1_which_means_a_group_differs() -> None:
    port = _closed_port()
    proc = _run("audit", env={"PRM_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}"})
    _assert_one_line_report(proc, "Kafka", f"127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stderr


@pytest.mark.slow  # the CLI as a child process
@pytest.mark.parametrize("command", [["worker"], ["trainer", "--max-steps", "1"], ["gateway"]])
def test_bad_event_loop_choice_is_a_config_error_before_connecting(command: list[str]) -> None:
    proc = _run(
        *command,
        env={
            "PRM_EVENT_LOOP": "tokio",
            "PRM_KAFKA_BOOTSTRAP": f"127.0.0.1:{_closed_port()}",
            "PRM_REDIS_URL": f"redis://127.0.0.1:{_closed_port()}/0",
        },
    )
    _assert_one_line_report(proc, "PRM_EVENT_LOOP='tokio'", "auto, uvloop, asyncio")
    assert proc.returncode == 2
    assert "not reachable" not in proc.stderr  # refused before waiting for any service
