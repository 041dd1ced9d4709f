"""The worker's tuning settings (``worker.max_attempts``, ``republish_grace_s``,
``sweep_interval_s``, ``sweep_backoff_s``, ``token_cache_bytes``): they load from the file
and the environment, are checked, and are what the worker actually uses.

The worker's control flow is exercised with stand-ins for the ledger and the dead-letter
step (no Kafka or Redis here: the integration tests cover those)."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from infra.config import ConfigError, PipelineConfig, WorkerConfig, config_from_mapping
from infra.schema import DiscardGroup
from prm_pipeline.demo.synthetic import make_session
from scoring_workers.jobs import Job, ReadyJob, job_of
from scoring_workers.ledger import ProbeOutcome
from scoring_workers.tokens import MemberTokens
from scoring_workers.worker import Worker


def test_defaults_are_the_former_constants() -> None:
    wc = WorkerConfig()
    assert (wc.max_attempts, wc.republish_grace_s, wc.sweep_interval_s, wc.sweep_backoff_s, wc.token_cache_bytes) == (
        3,
        5.0,
        0.5,
        30.0,
        256 * 1024 * 1024,
    )


def test_settings_load_from_the_file_and_the_environment() -> None:
    cfg = config_from_mapping(
        {"worker": {"max_attempts": 5, "republish_grace_s": 2.5, "sweep_interval_s": 0.2, "token_cache_bytes": 1024}},
        environ={"PRM_WORKER_SWEEP_BACKOFF_S": "12"},
    )
    wc = cfg.worker
    assert (wc.max_attempts, wc.republish_grace_s, wc.sweep_interval_s, wc.sweep_backoff_s, wc.token_cache_bytes) == (
        5,
        2.5,
        0.2,
        12.0,
        1024,
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_attempts", 0),
        ("republish_grace_s", 0),
        ("sweep_interval_s", -1),
        ("sweep_backoff_s", ".inf"),
        ("token_cache_bytes", -1),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"worker.{key}"):
        config_from_mapping({"worker": {key: value}}, environ={})


class _Ledger:
    """Records the calls the worker makes; ``decide`` fails as told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, ...]] = []

    async def nudge(self, group_id: str, grace_s: float) -> None:
        self.calls.append(("nudge", group_id, grace_s))

    async def postpone(self, group_id: str, delay_s: float) -> None:
        self.calls.append(("postpone", group_id, delay_s))

    async def due_groups(self, **kw: Any) -> list[str]:
        return ["broken"]

    async def decide(self, group_id: str, kind: str, **kw: Any) -> Any:
        self.calls.append(("decide", group_id, kw["republish_grace_s"]))
        raise ValueError("a stored decision that does not decode")


def _worker(**settings: Any) -> tuple[Worker, _Ledger]:
    worker = Worker(PipelineConfig(worker=WorkerConfig(**settings)), worker_id="w-unit")
    ledger = _Ledger()
    worker._attach(ledger, None)  # type: ignore[arg-type]
    return worker, ledger


def _job(worker: Worker, message: Any) -> Job:
    record = ConsumerRecord("traj", 0, 7, 0, 0, b"g", b"", None, 1, 0, [])
    return job_of(record, message, worker._route(record, message), [], 0.0)


async def test_max_attempts_bounds_the_retries_before_a_dead_letter() -> None:
    worker, _ = _worker(max_attempts=5)
    handled: list[int] = []
    dead: list[int] = []

    async def failing_discard(job: Any) -> None:
        handled.append(1)
        raise RuntimeError("a bug")

    async def dead_letter(record: Any, error: BaseException, attempt: int, **kw: Any) -> None:
        dead.append(attempt)

    worker.settler.dead_letter = dead_letter  # type: ignore[method-assign]
    worker._handle = failing_discard  # type: ignore[method-assign]
    await worker._process(_job(worker, DiscardGroup(group_id="g")))
    assert (len(handled), dead) == (5, [5])


async def test_the_sweeper_uses_the_grace_and_backs_off_by_the_settings() -> None:
    worker, ledger = _worker(republish_grace_s=7.5, sweep_backoff_s=42.0)
    await worker.sweeper.sweep()
    assert ledger.calls == [("decide", "broken", 7.5), ("postpone", "broken", 42.0)]


async def test_a_member_of_a_decided_group_nudges_it_by_the_grace() -> None:
    worker, ledger = _worker(republish_grace_s=3.0)
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=2, turns=1, output_tokens=4)
    job = _job(worker, traj)
    assert isinstance(job, ReadyJob)
    job.probe = ProbeOutcome.DECIDED
    await worker._handle(job)
    assert ledger.calls == [("nudge", "g", 3.0)]


def test_the_token_cache_is_sized_by_the_setting() -> None:
    assert MemberTokens(PipelineConfig(worker=WorkerConfig(token_cache_bytes=4096))).max_bytes == 4096
