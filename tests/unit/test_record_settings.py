"""What a registry record may set: durations and rates have floors (below them a value is
not tuning but a failure of every call), in the scorers' settings and in the spec."""

from __future__ import annotations

import json

import pytest

from infra.config import PRMConfig, PRMScorerConfig
from infra.registry import RegistryError, decode_record
from scoring_workers.prm.capabilities import CapabilityError, record_prm
from scoring_workers.scorers.record_settings import MIN_RECORD_RPS, MIN_RECORD_SECONDS

OPENCLAW = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"


def _record(**kwargs) -> PRMConfig:
    return PRMConfig(scorers=[PRMScorerConfig(OPENCLAW, kwargs={"base_url": "http://judge:1", **kwargs})])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", 1e-300),
        ("total_timeout_s", 0.001),
        ("turn_timeout_s", 0.05),
        ("breaker_reset_s", 1e-300),
        ("rps", 1e-9),
    ],
)
def test_a_record_cannot_set_a_duration_or_rate_below_its_floor(field: str, value: float) -> None:
    with pytest.raises(CapabilityError, match=rf"kwargs\.{field}: Expected `float` >= "):
        record_prm(_record(**{field: value}), {}, allowed_prefixes=["scoring_workers.scorers"])


def test_the_floors_themselves_are_settable() -> None:
    prm = record_prm(
        _record(timeout_s=MIN_RECORD_SECONDS, rps=MIN_RECORD_RPS), {}, allowed_prefixes=["scoring_workers.scorers"]
    )
    assert prm.scorers[0].kwargs["timeout_s"] == MIN_RECORD_SECONDS


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"judge_quota": {"rps": 1e-300}}, "judge_quota.rps"),
        ({"group_timeout_s": 1e-300}, "group_timeout_s"),
    ],
)
def test_a_specs_rate_and_timeout_have_floors(spec: dict, where: str) -> None:
    value = json.dumps({"experiment_id": "exp-f", "prm": {"scorers": []}, **spec}).encode()
    with pytest.raises(RegistryError, match=where):
        decode_record(b"exp-f", value)
