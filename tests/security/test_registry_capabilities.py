"""A registry record is data: it may choose and tune what the operator declared, never load
code, read the worker's environment or files, or stop a worker.

* Each scorer class declares what a record may set (``record_settings``); every other
  argument is operator-only and reaches a scorer only through the operator's own
  ``worker.scorer_profiles`` (docs/security.md, "Registry records").
* A Hugging Face tokenizer never runs the code its files name unless the operator's own
  file turns ``trust_remote_code`` on.
* Every record is decoded on its own with a size and depth bound: a poison record is
  refused alone, and a worker started after it starts and applies its neighbours.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

from infra.config import ConfigError, PRMConfig, PRMScorerConfig, config_from_mapping
from infra.kafka import ensure_topics, make_producer
from infra.registry import ExperimentSpec, RegistryError, decode_record
from scoring_workers.prm.capabilities import CapabilityError, constructor_arguments, record_prm, settable_fields
from tests.integration.harness import running_worker, with_scorers
from tests.integration.test_fleet import LENGTH, _declare, _serving, _spec

ROOT = Path(__file__).resolve().parents[2]
OPENCLAW = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"
OPD = "scoring_workers.scorers.opd.OPDTeacherScorer"
JUDGE = {"base_url": "http://judge.internal:8000/v1", "model": "judge"}
ALLOWED = ["scoring_workers.scorers", "tests.scorers", "tests.security.undeclared_scorer", "examples.prm"]


def _evil_tokenizer(tmp: Path) -> tuple[Path, Path]:
    """A tokenizer folder whose config names Python code (``auto_map``); the code leaves a mark."""
    folder, mark = tmp / "evil-tokenizer", tmp / "RAN"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"}
        )
    )
    (folder / "evil_tok.py").write_text(
        f"import pathlib\npathlib.Path({str(mark)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizer\nclass EvilTokenizer(PreTrainedTokenizer):\n    pass\n"
    )
    return folder, mark


def _record(*entries: PRMScorerConfig) -> PRMConfig:
    return PRMConfig(scorers=list(entries))


@pytest.mark.parametrize(
    ("path", "kwargs", "needle"),
    [
        (OPD, {**JUDGE, "tokenizer": "hf:/models/evil"}, "kwargs.tokenizer: operator-only (loads code"),
        (OPD, {**JUDGE, "trust_remote_code": True}, "kwargs.trust_remote_code: operator-only"),
        (
            OPENCLAW,
            {**JUDGE, "api_key_env": "AWS_SECRET_ACCESS_KEY"},
            "kwargs.api_key_env: operator-only (reads a variable",
        ),
        (OPENCLAW, {**JUDGE, "api_key_file": "/etc/shadow"}, "kwargs.api_key_file: operator-only (reads a file"),
        (OPENCLAW, {**JUDGE, "headers": {"X-Forwarded-For": "x"}}, "kwargs.headers: operator-only"),
        (OPENCLAW, {**JUDGE, "chat_template": "os:system"}, "kwargs.chat_template: operator-only (imports and runs"),
        (OPENCLAW, {**JUDGE, "audit_sink": "os:system"}, "kwargs.audit_sink: operator-only"),
        (OPENCLAW, {**JUDGE, "policy_tokenizer": "/etc"}, "kwargs.policy_tokenizer: operator-only (reads a tokenizer"),
        (OPENCLAW, {**JUDGE, "m": 10**9}, "kwargs.m: Expected `int` <= 64"),
        (OPENCLAW, {**JUDGE, "temperature": "hot"}, "kwargs.temperature: Expected `float`, got `str`"),
        (OPENCLAW, {**JUDGE, "modle": "x"}, "did you mean `model`?"),
        (
            "tests.security.undeclared_scorer.UndeclaredScorer",
            {"model_path": "/etc/passwd"},
            "operator-only (the scorer does not declare it record-settable)",
        ),
    ],
)
def test_a_record_cannot_set_what_only_the_operator_may(path: str, kwargs: dict, needle: str) -> None:
    with pytest.raises(CapabilityError) as info:
        record_prm(_record(PRMScorerConfig(path, kwargs=kwargs)), {}, allowed_prefixes=ALLOWED)
    message = str(info.value)
    assert needle in message and message.startswith("prm.scorers[0]"), message
    assert "\n" not in message


def test_a_record_tunes_an_operator_profile_and_keeps_its_operator_only_arguments() -> None:
    profiles = {"judge-prod": PRMScorerConfig(OPENCLAW, kwargs={**JUDGE, "api_key_env": "JUDGE_KEY", "m": 3})}
    prm = record_prm(
        _record(PRMScorerConfig(profile="judge-prod", weight=0.5, kwargs={"m": 5, "temperature": 0.0})),
        profiles,
        allowed_prefixes=ALLOWED,
    )
    (entry,) = prm.scorers
    assert entry.path == OPENCLAW and entry.weight == 0.5
    assert entry.kwargs == {**JUDGE, "api_key_env": "JUDGE_KEY", "m": 5, "temperature": 0.0}
    with pytest.raises(CapabilityError, match="no scorer profile `judge-prd`.*did you mean `judge-prod`"):
        record_prm(_record(PRMScorerConfig(profile="judge-prd")), profiles, allowed_prefixes=ALLOWED)
    with pytest.raises(CapabilityError, match="api_key_env: operator-only"):  # a profile is tuned, not rewritten
        record_prm(
            _record(PRMScorerConfig(profile="judge-prod", kwargs={"api_key_env": "AWS_SECRET_ACCESS_KEY"})),
            profiles,
            allowed_prefixes=ALLOWED,
        )


def test_every_builtin_argument_is_either_record_settable_or_operator_only_with_a_reason() -> None:
    from scoring_workers.scorers import LengthBudgetScorer, OPDTeacherScorer, OpenClawJudgeScorer

    for cls in (LengthBudgetScorer, OpenClawJudgeScorer, OPDTeacherScorer):
        settable, arguments = set(settable_fields(cls)), set(constructor_arguments(cls))
        operator_only = set(cls.operator_only)
        assert settable <= arguments, (cls, settable - arguments)  # no declaration for an argument that is gone
        assert settable.isdisjoint(operator_only), cls
        assert arguments == settable | operator_only, (cls, arguments - settable - operator_only)


def test_the_operators_own_config_uses_profiles_too() -> None:
    cfg = config_from_mapping(
        {
            "worker": {
                "scorer_profiles": {
                    "budget": {"path": "scoring_workers.scorers.LengthBudgetScorer", "kwargs": {"max_output_tokens": 8}}
                }
            },
            "rollout": {"agent": {"prm": {"scorers": [{"profile": "budget", "weight": 2.0}]}}},
            "actor": {"token_rewards_as_adv": True},
        },
        environ={},
    )
    (entry,) = cfg.prm.scorers
    assert (entry.path, entry.weight, entry.kwargs) == (
        "scoring_workers.scorers.LengthBudgetScorer",
        2.0,
        {"max_output_tokens": 8},
    )
    with pytest.raises(ConfigError, match="no scorer profile `budgte`"):
        config_from_mapping({"rollout": {"agent": {"prm": {"scorers": [{"profile": "budgte"}]}}}}, environ={})


def test_an_hf_tokenizer_never_runs_its_code_unless_the_operator_trusts_it_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scoring_workers.scorers.opd import hf_chat_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, mark = _evil_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code"):
        hf_chat_tokenizer(str(folder))([{"role": "user", "content": "hi"}])
    assert not mark.exists(), "the tokenizer's own code ran"


def test_a_record_nested_30000_deep_is_refused_as_data() -> None:
    value = b'{"experiment_id": "exp-deep", "prm": {"scorers": [' + b"[" * 30_000 + b"]" * 30_000 + b"]}}"
    with pytest.raises(RegistryError, match="nested deeper than"):
        decode_record(b"exp-deep", value)


async def test_a_worker_started_after_a_poison_record_starts_and_applies_the_records_next_to_it(
    pipeline_config,
) -> None:
    cfg = with_scorers(pipeline_config, LENGTH)
    deep = b'{"experiment_id": "exp-deep", "prm": {"scorers": [' + b"[" * 30_000 + b"]" * 30_000 + b"]}}"
    secret = _spec(
        "exp-secret",
        PRMScorerConfig(OPENCLAW, kwargs={"base_url": "http://127.0.0.1:9/v1", "api_key_env": "AWS_SECRET_ACCESS_KEY"}),
    )
    await ensure_topics(
        cfg.kafka,
        cfg.topics,
        [cfg.topics.experiments, f"{cfg.topics.trajectories}.exp-good", f"{cfg.topics.verdicts}.exp-good"],
    )  # as `experiment add` does
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:  # the poison records and a good one after them, all on the compacted topic before any worker starts
        for key, value in [
            (b"exp-deep", deep),
            (b"exp-secret", msgspec.json.encode(secret)),
            (b"exp-good", msgspec.json.encode(_spec("exp-good", LENGTH))),
        ]:
            await producer.send_and_wait(cfg.topics.experiments, value, key=key)
    finally:
        await producer.stop()
    async with running_worker(cfg, "w-poison") as worker:  # on the old code: RecursionError, the worker exits
        await _serving(worker, "exp-good")
        refused = worker.telemetry.registry_records.labels("refused")._value.get()
        assert worker.fleet.get("exp-deep") is None and worker.fleet.get("exp-secret") is None
        await _declare(cfg, _spec("exp-later", LENGTH))  # and it keeps following the registry
        await _serving(worker, "exp-later")
    assert refused == 2


def test_experiment_add_refuses_operator_only_arguments_before_connecting(tmp_path: Path) -> None:
    folder, mark = _evil_tokenizer(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kafka": {"bootstrap": "127.0.0.1:1", "startup_timeout_s": 3600},
                "worker": {"allowed_judge_hosts": ["127.0.0.1"]},
            }
        )
    )
    for name, kwargs, needle in [
        ("tok", {"base_url": "http://127.0.0.1:9/v1", "tokenizer": f"hf:{folder}"}, "kwargs.tokenizer: operator-only"),
        (
            "key",
            {"base_url": "http://127.0.0.1:9/v1", "api_key_env": "AWS_SECRET_ACCESS_KEY"},
            "kwargs.api_key_env: operator-only",
        ),
    ]:
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(
            yaml.safe_dump({"experiment_id": f"exp-{name}", "prm": {"scorers": [{"path": OPD, "kwargs": kwargs}]}})
        )
        proc = subprocess.run(
            [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), "experiment", "add", str(spec)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )  # waiting for the closed broker would take an hour
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert "prm.scorers[0]" in proc.stderr
    assert not mark.exists()


def test_the_spec_keeps_profile_entries_as_data() -> None:
    spec = decode_record(
        b"exp-p",
        json.dumps(
            {"experiment_id": "exp-p", "prm": {"scorers": [{"profile": "judge-prod", "kwargs": {"m": 5}}]}}
        ).encode(),
    )
    assert isinstance(spec, ExperimentSpec) and spec.prm.scorers[0].profile == "judge-prod"
