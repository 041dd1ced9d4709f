"""One default per judge setting: the settings structs hold it, the scorers' flat keyword
arguments map onto those structs without restating it, and the documented YAML examples agree.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from scoring_workers.judge.limits import DEFAULT_LIMITS
from scoring_workers.judge.settings import (
    ClientSettings,
    ConnectionSettings,
    LimitSettings,
    ModelSettings,
    RequestSettings,
    SpillPolicy,
)
from scoring_workers.prm.resolve import ScorerArgumentError
from scoring_workers.scorers import openclaw
from scoring_workers.scorers.openclaw import FLAT_SETTINGS, JudgeScorerBase, JudgingSettings, OpenClawJudgeScorer

ROOT = Path(__file__).resolve().parents[2]
STRUCTS = (ModelSettings, JudgingSettings, RequestSettings, LimitSettings, ConnectionSettings, SpillPolicy)


def _struct_defaults(struct: type[msgspec.Struct]) -> dict[str, Any]:
    return {
        f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        for f in msgspec.structs.fields(struct)
        if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
    }


# A value other than the default for every flat keyword argument of a judge scorer.
OTHER: dict[str, Any] = {
    "next_state": "first",
    "merge_tool_results": True,
    "m": 5,
    "on_all_votes_failed": "neutral",
    "turn_timeout_s": 9.0,
    "api": "sglang",
    "model": "qwen3-8b",
    "temperature": 0.0,
    "max_tokens": 77,
    "top_p": 0.5,
    "top_k": 20,
    "include_reasoning": False,
    "timeout_s": 3.0,
    "total_timeout_s": 7.0,
    "max_retries": 4,
    "backoff_base_s": 0.01,
    "backoff_max_s": 0.5,
    "max_concurrency": 3,
    "rps": 2.0,
    "breaker_failure_threshold": 9,
    "breaker_reset_s": 4.0,
    "headers": {"X-Team": "rl"},
    "api_key_env": "JUDGE_KEY_FOR_TEST",
    "api_key_file": "/nonexistent/judge.key",
    "spill_in_flight": 2,
    "spill_ratio": 3.0,
}


def _owners(scorer: JudgeScorerBase) -> dict[type[msgspec.Struct], msgspec.Struct]:
    client = scorer.client_settings
    return {
        JudgingSettings: scorer.judging,
        ModelSettings: scorer.endpoint.settings,
        RequestSettings: client.request,
        LimitSettings: client.limits,
        ConnectionSettings: client.connection,
        SpillPolicy: client.spill,
    }


def test_every_flat_keyword_is_a_field_of_one_settings_struct() -> None:
    assert set(FLAT_SETTINGS) == set(OTHER)  # a new setting gets a row above
    assert all(FLAT_SETTINGS[name] in STRUCTS for name in FLAT_SETTINGS)
    assert {"api_key", "trust_env", "retry_on_timeout"}.isdisjoint(FLAT_SETTINGS)  # code only: no key in YAML


@pytest.mark.parametrize("name", sorted(OTHER))
def test_each_flat_keyword_lands_in_its_settings_struct(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scorer restates no default: a keyword it is given reaches its struct, every other
    field of every struct keeps that struct's own default."""
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "k")  # api_key_env wins over api_key_file: the file is not read
    extra = {"next_state": "first"} if name == "merge_tool_results" else {}
    extra |= {"api_key_env": "JUDGE_KEY_FOR_TEST"} if name == "api_key_file" else {}
    scorer = OpenClawJudgeScorer(base_url="http://judge:30000", **{name: OTHER[name]}, **extra)
    try:
        for struct, built in _owners(scorer).items():
            expected = {
                **_struct_defaults(struct),
                **{k: v for k, v in {name: OTHER[name], **extra}.items() if FLAT_SETTINGS[k] is struct},
            }
            assert msgspec.structs.asdict(built) == expected, struct.__name__
    finally:
        scorer._release_unopened()


def test_the_signature_lists_each_flat_keyword_with_its_struct_default() -> None:
    params = inspect.signature(JudgeScorerBase.__init__).parameters
    for name, struct in FLAT_SETTINGS.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == _struct_defaults(struct)[name], name


def test_an_unknown_keyword_is_refused_with_the_closest_one() -> None:
    with pytest.raises(ScorerArgumentError, match="unexpected keyword argument `timeout`; did you mean `timeout_s`"):
        OpenClawJudgeScorer(base_url="http://judge:30000", timeout=5)
    with pytest.raises(ScorerArgumentError, match="`api_key`"):  # a key never comes from a scorer's kwargs
        OpenClawJudgeScorer(base_url="http://judge:30000", api_key="s3cr3t")


def test_a_scorer_built_with_its_defaults_has_the_default_structs() -> None:
    scorer = OpenClawJudgeScorer(base_url="http://judge:30000")
    try:
        assert scorer.client_settings == ClientSettings()
        assert scorer.endpoint.settings == ModelSettings()
        assert scorer.judging == JudgingSettings()
        assert scorer.max_votes is None and scorer.adaptive is True
    finally:
        scorer._release_unopened()


def _yaml_kwargs(text: str) -> dict[str, Any]:
    """The ``kwargs:`` mapping of the first scorer YAML example in ``text``."""
    match = re.search(r"^( *)kwargs:\n((?:\1  .*\n)+)", text, re.M)
    assert match, "no kwargs: block"
    return yaml.safe_load(re.sub(r"^ *#.*\n", "", match.group(2)))


def _documented() -> list[tuple[str, dict[str, Any]]]:
    section = (ROOT / "docs" / "judge.md").read_text(encoding="utf-8").split("## 3. `OpenClawJudgeScorer`")[1]
    return [("openclaw docstring", _yaml_kwargs(openclaw.__doc__ or "")), ("docs/judge.md", _yaml_kwargs(section))]


@pytest.mark.parametrize(("where", "kwargs"), _documented(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_documented_examples_state_the_defaults(where, kwargs) -> None:
    """Every setting the example spells out has its default value (``model`` and the
    server URLs are examples; the limits show what an endpoint gets when none is set)."""
    limits = msgspec.structs.asdict(DEFAULT_LIMITS)
    expected = {
        **{k: v for s in STRUCTS for k, v in _struct_defaults(s).items()},
        **limits,
        "adaptive": True,
        "max_votes": 3,
        "policy_tokenizer": None,
        "chat_template": None,
        "audit_sink": None,
    }
    checked = {k: v for k, v in kwargs.items() if k in expected and k != "model"}
    assert {"timeout_s", "total_timeout_s", "m", "max_retries", "temperature"} <= set(checked)
    wrong = {k: (v, expected[k]) for k, v in checked.items() if v != expected[k]}
    assert wrong == {}, f"{where}: documented (value, default): {wrong}"
