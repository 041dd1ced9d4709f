"""The experiment registry is not a way to run code on workers or to send trajectories anywhere.

* Every record is validated as data before it takes effect (schema, key, sizes, quotas);
  a malformed record is refused with one line and never stops a worker.
* Scorer modules named by a record must be under the *worker's* ``worker.allowed_scorer_modules``
  (checked before anything is imported) and judge URLs under the worker's judge host
  allow-list; a refused record is logged, counted for the alert, and the worker goes on
  serving the other experiments (an experiment already running keeps its last good declaration).
* ``prm-pipeline experiment add`` refuses such a file before it connects to anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from infra.config import PRMConfig, PRMScorerConfig
from infra.experiments import trajectories_topic
from infra.kafka import make_producer
from infra.registry import MAX_RECORD_BYTES, ExperimentSpec, RegistryError, decode_record, encode_spec, publish_spec
from tests.integration.harness import running_worker, with_scorers
from tests.integration.test_fleet import LENGTH, _declare, _serving, _spec

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"experiment_id": "exp-ok", "prm": {"scorers": [{"path": "examples.prm.scorers.LengthBudgetScorer"}]}}


def _value(data: object) -> bytes:
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        (b"exp-ok", b"{not json", "not valid JSON"),
        (b"exp-ok", _value({**GOOD, "weigth": 2}), "did you mean `weight`"),
        (b"exp-ok", _value({**GOOD, "prm": {"scorers": [{"path": "x.Y", "kwarg": {}}]}}), "kwarg"),
        (b"other", _value(GOOD), "the key and experiment_id must agree"),
        (b"bad key!", _value(GOOD), "experiment_id"),
        (b"default", _value({**GOOD, "experiment_id": "default"}), "the workers' own config file"),
        (b"exp-ok", _value({**GOOD, "max_in_flight": 0}), "max_in_flight"),
        (b"exp-ok", _value({**GOOD, "weight": 1e9}), "weight"),
        (b"exp-ok", _value({**GOOD, "judge_quota": {"rps": -1}}), "rps"),
        (b"exp-ok", _value({**GOOD, "prm": {"scorers": []}}), "no enabled scorer"),
        (b"exp-ok", b"{" + b" " * MAX_RECORD_BYTES + b"}", "over the limit"),
        (b"exp-ok", _value([1, 2]), "must be a mapping"),
    ],
)
def test_malformed_records_are_refused_as_data_with_one_line(key: bytes, value: bytes, needle: str) -> None:
    with pytest.raises(RegistryError, match=needle) as info:
        decode_record(key, value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 600


def test_a_well_formed_record_round_trips_and_a_tombstone_is_a_removal() -> None:
    spec = decode_record(b"exp-ok", _value(GOOD))
    assert spec is not None and spec.experiment_id == "exp-ok"
    key, value, _ = encode_spec(spec)
    assert decode_record(key, value) == spec
    assert decode_record(b"exp-ok", None) is None


async def test_a_record_naming_code_or_hosts_outside_the_workers_lists_is_refused_and_the_worker_goes_on(
    pipeline_config,
) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)  # allowed: scoring_workers.scorers, tests.scorers; no judge hosts
    evil = _spec("exp-evil", PRMScorerConfig("tests.security.registry_payload.Payload"))
    judge = _spec(
        "exp-judge",
        PRMScorerConfig(
            "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
            kwargs={"base_url": "http://exfiltrate.example:8000/v1", "model": "judge"},
        ),
    )
    async with running_worker(cfg, "w-registry-rules") as worker:
        await _declare(cfg, _spec("exp-kept", LENGTH, weight=2.0))
        await _serving(worker, "exp-kept")
        await publish_spec(cfg, evil)
        await publish_spec(cfg, judge)
        await publish_spec(
            cfg,
            msgspec.structs.replace(
                _spec("exp-kept", PRMScorerConfig("tests.security.registry_payload.Payload")), weight=3.0
            ),
        )  # a refused replacement
        producer = make_producer(cfg.kafka)
        await producer.start()
        try:
            await producer.send_and_wait(cfg.topics.experiments, b"\x00garbage", key=b"exp-junk")
        finally:
            await producer.stop()
        await _declare(cfg, _spec("exp-after", LENGTH))  # the worker still applies what follows
        await _serving(worker, "exp-after")
        refused = worker.telemetry.registry_records.labels("refused")._value.get()
        subscribed = worker.consumer.subscription()
        kept = worker.fleet.get("exp-kept")
    assert refused == 4
    assert "tests.security.registry_payload" not in sys.modules  # refused before anything was imported
    assert worker.fleet.get("exp-evil") is None and worker.fleet.get("exp-judge") is None
    assert kept is not None and kept.weight == 2.0  # its last good declaration
    assert trajectories_topic(cfg.topics.trajectories, "exp-evil") not in subscribed  # no worker reads its topic


def test_experiment_add_refuses_a_file_outside_the_allow_lists_before_connecting(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"kafka": {"bootstrap": "127.0.0.1:1", "startup_timeout_s": 3600}}))
    for name, scorer, needle in [
        ("code", {"path": "tests.security.registry_payload.Payload"}, "not under the allowed prefixes"),
        (
            "host",
            {
                "path": "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
                "kwargs": {"base_url": "http://exfiltrate.example:8000/v1", "model": "judge"},
            },
            "worker.allowed_judge_hosts",
        ),
    ]:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(yaml.safe_dump({"experiment_id": f"exp-{name}", "prm": {"scorers": [scorer]}}))
        proc = subprocess.run(
            [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), "experiment", "add", str(spec)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )  # waiting for the closed broker would take an hour
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert "prm.scorers[0]" in proc.stderr and "rollout.agent" not in proc.stderr  # the file's own keys


def test_the_spec_type_names_every_field_the_docs_show() -> None:
    fields = {f.encode_name for f in msgspec.structs.fields(ExperimentSpec)}
    assert fields == {
        "experiment_id",
        "prm",
        "weight",
        "max_in_flight",
        "group_timeout_s",
        "judge_quota",
        "description",
    }
    assert isinstance(ExperimentSpec(experiment_id="e", prm=PRMConfig(scorers=[LENGTH])).prm, PRMConfig)
