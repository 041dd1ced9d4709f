"""A worker's registry catch-up (Fleet.settle) and removals timed by their records' timestamps."""

from __future__ import annotations

import time

from infra.config import PipelineConfig, PRMConfig, PRMScorerConfig, WorkerConfig
from infra.registry import ExperimentSpec, RegistryRecord
from scoring_workers.fleet import Fleet

LENGTH = PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer")
NOW = 1_700_000_000.0


def _spec(experiment_id: str, **fields) -> ExperimentSpec:
    return ExperimentSpec(experiment_id=experiment_id, prm=PRMConfig(scorers=[LENGTH]), **fields)


def _fleet() -> Fleet:
    return Fleet(PipelineConfig(worker=WorkerConfig(group_timeout_s=60)), None)


def _at(seconds_ago: float) -> int:
    return int((NOW - seconds_ago) * 1000)


def test_settle_keeps_each_experiments_current_state_only() -> None:
    a1, a2 = _spec("exp-a", weight=1.0), _spec("exp-a", weight=2.0)
    records = [
        RegistryRecord("exp-a", a1, 0, timestamp_ms=_at(500)),
        RegistryRecord("exp-gone", _spec("exp-gone"), 1, timestamp_ms=_at(400)),
        RegistryRecord("exp-a", None, 2, error="not JSON", timestamp_ms=_at(300)),
        RegistryRecord("exp-gone", None, 3, timestamp_ms=_at(61)),  # removed over its 60 s ago
        RegistryRecord("exp-a", a2, 4, timestamp_ms=_at(200)),
        RegistryRecord("exp-late", _spec("exp-late", group_timeout_s=30), 5, timestamp_ms=_at(100)),
        RegistryRecord("exp-late", None, 6, timestamp_ms=_at(20)),  # removed 20 s of its 30 ago
        RegistryRecord("exp-late", None, 7, timestamp_ms=_at(10)),
        RegistryRecord("exp-late", None, 8, error="bad key", timestamp_ms=_at(5)),
        RegistryRecord("exp-orphan", None, 9, timestamp_ms=_at(1)),  # its declaration compacted away
    ]
    kept = _fleet().settle(records, now=NOW)
    assert [r.offset for r in kept] == [4, 5, 6, 8]


async def test_a_removal_retires_for_the_rest_of_the_group_timeout_from_its_timestamp() -> None:
    fleet = _fleet()
    await fleet.apply(RegistryRecord("exp-a", _spec("exp-a", group_timeout_s=30), 0))
    await fleet.apply(RegistryRecord("exp-a", None, 1, timestamp_ms=int((time.time() - 20) * 1000)))
    left = fleet.get("exp-a").retire_at - time.monotonic()
    assert 8 < left <= 10.5, left
    await fleet.apply(RegistryRecord("exp-b", _spec("exp-b", group_timeout_s=30), 2))
    await fleet.apply(RegistryRecord("exp-b", None, 3, timestamp_ms=int((time.time() + 3600) * 1000)))  # clock skew
    assert fleet.get("exp-b").retire_at - time.monotonic() <= 30  # never more than the whole timeout
    await fleet.aclose()
