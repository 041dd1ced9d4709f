"""One default per judge setting: the scorers' keyword defaults, the settings structs'
defaults and the documented YAML examples agree.

The scorer passes each of its keyword arguments to the structs explicitly, so its
signature decides what a user gets; the structs must say the same, or code that builds a
struct directly gets another judge than the YAML that looks identical.
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
from scoring_workers.scorers import openclaw
from scoring_workers.scorers.openclaw import JudgeScorerBase, JudgingSettings, OpenClawJudgeScorer

ROOT = Path(__file__).resolve().parents[2]
STRUCTS = (ModelSettings, JudgingSettings, RequestSettings, LimitSettings, ConnectionSettings, SpillPolicy)


def _scorer_defaults() -> dict[str, Any]:
    params = inspect.signature(JudgeScorerBase.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _struct_defaults(struct: type[msgspec.Struct]) -> dict[str, Any]:
    return {f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            for f in msgspec.structs.fields(struct)
            if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT}


def _settings_fields() -> list[tuple[type[msgspec.Struct], str, Any]]:
    scorer = _scorer_defaults()
    return [(struct, name, default) for struct in STRUCTS for name, default in _struct_defaults(struct).items()
            if name in scorer]


@pytest.mark.parametrize(("struct", "name", "default"), _settings_fields(),
                         ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_each_scorer_default_equals_the_settings_struct_default(struct, name, default) -> None:
    given = _scorer_defaults()[name]
    if name == "headers":  # the scorer's None means "no headers": the struct's {}
        given = {} if given is None else given
    assert given == default, f"JudgeScorerBase(..., {name}={given!r}) but {struct.__name__}.{name} = {default!r}"


def test_every_settings_keyword_of_the_scorer_is_checked() -> None:
    fields = {name for struct in STRUCTS for name in struct.__struct_fields__}
    settings_kwargs = set(_scorer_defaults()) & fields
    assert settings_kwargs == {name for _, name, _ in _settings_fields()}
    assert len(settings_kwargs) >= 25, sorted(settings_kwargs)


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
    expected = {**{k: v for s in STRUCTS for k, v in _struct_defaults(s).items()}, **limits,
                "adaptive": True, "max_votes": 3, "policy_tokenizer": None, "chat_template": None,
                "audit_sink": None}
    checked = {k: v for k, v in kwargs.items() if k in expected and k != "model"}
    assert {"timeout_s", "total_timeout_s", "m", "max_retries", "temperature"} <= set(checked)
    wrong = {k: (v, expected[k]) for k, v in checked.items() if v != expected[k]}
    assert wrong == {}, f"{where}: documented (value, default): {wrong}"
