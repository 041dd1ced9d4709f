"""One import resolver for everything a config names, enforcing worker.allowed_scorer_modules."""

from __future__ import annotations

import sys

import pytest

from infra.config import ConfigError, PRMConfig, PRMScorerConfig
from scoring_workers.judge.limits import registered_limits
from scoring_workers.prm import BaseScorer
from scoring_workers.prm.resolve import (
    ScorerArgumentError,
    allowed_modules,
    build_scorer,
    check_scorer_entries,
    check_scorer_kwargs,
    resolve_callable,
    resolve_import,
    resolve_scorer_class,
)

ALLOWED = ["scoring_workers.scorers"]
URL = "http://127.0.0.1:9"  # never contacted: constructors make no request


def _judge_entry(**kwargs) -> dict:
    return {"path": "scoring_workers.scorers.openclaw.OpenClawJudgeScorer", "kwargs": {"base_url": URL, **kwargs}}


@pytest.mark.parametrize("setting", ["chat_template", "audit_sink"])
def test_judge_callables_named_in_config_obey_the_allow_list(setting):
    # Before: the judge resolved these with its own importer and imported os.getcwd happily.
    with pytest.raises(
        ConfigError,
        match=rf"{setting} 'os:getcwd' is refused: module 'os' is not under "
        r"the allowed prefixes \['scoring_workers.scorers'\]",
    ):
        build_scorer(_judge_entry(**{setting: "os:getcwd"}), allowed_prefixes=ALLOWED)
    assert registered_limits(URL) is None  # the failed constructor released its client


def test_opd_tokenizer_named_in_config_obeys_the_allow_list():
    entry = {
        "path": "scoring_workers.scorers.opd.OPDTeacherScorer",
        "kwargs": {"base_url": URL, "tokenizer": "os.path.basename"},
    }
    with pytest.raises(ConfigError, match=r"tokenizer 'os.path.basename' is refused: module 'os.path'"):
        build_scorer(entry, allowed_prefixes=ALLOWED)


def test_one_message_for_every_kind_of_path():
    messages = []
    for what, path in (("scorer path", "collections.OrderedDict"), ("chat_template", "json:dumps")):
        with pytest.raises(ConfigError) as info:
            resolve_import(path, what, allowed_prefixes=ALLOWED)
        messages.append(str(info.value).replace(what, "WHAT").replace(path, "PATH").split(": module")[0])
    assert messages[0] == messages[1] == "WHAT 'PATH' is refused"
    assert "add its package to worker.allowed_scorer_modules" in str(info.value)


def test_allowed_paths_resolve_inside_and_outside_the_context():
    with allowed_modules(["scoring_workers.scorers"]):
        fn = resolve_callable("scoring_workers.scorers.conversation:render_chatml", "chat_template")
        assert fn([{"role": "user", "content": "x"}]).startswith("<|im_start|>user")
        with pytest.raises(ConfigError):
            resolve_callable("json.dumps", "audit_sink")
    assert resolve_callable("json.dumps", "audit_sink")({"a": 1}) == '{"a": 1}'  # no allow-list outside
    assert resolve_callable(len, "audit_sink") is len  # a callable passes through


def test_resolution_errors():
    with pytest.raises(ConfigError, match="form"):
        resolve_import("nodots", "chat_template")
    with pytest.raises(ImportError, match="no attribute"):
        resolve_import("json:nope", "chat_template")
    with pytest.raises(TypeError, match="not callable"):
        resolve_callable("math:pi", "audit_sink")


def test_allowed_judge_scorer_with_allowed_callables_builds():
    scorer, owned = build_scorer(
        _judge_entry(chat_template="scoring_workers.scorers.conversation:render_chatml", api="sglang"),
        allowed_prefixes=ALLOWED,
    )
    try:
        assert owned and scorer.endpoint.chat_template.__name__ == "render_chatml"
    finally:
        scorer.client.discard()
    assert registered_limits(URL) is None


# --------------------------------------------------------------------------- kwargs, imports, shadowing
class _NeedsThreshold(BaseScorer):
    name = "needs_threshold"

    def __init__(self, weight: float = 1.0, enabled: bool = True, *, threshold: float) -> None:
        super().__init__(weight, enabled)
        self.threshold = threshold

    async def evaluate(self, interaction, ctx):
        return 0.0


class _Forwards(_NeedsThreshold):
    """Takes **kwargs and hands them up, as AReaL's scorers do."""

    name = "forwards"

    def __init__(self, weight: float = 1.0, enabled: bool = True, *, scale: float = 1.0, **kwargs) -> None:
        super().__init__(weight, enabled, **kwargs)
        self.scale = scale


class _Open(BaseScorer):
    name = "open"

    def __init__(self, **kwargs) -> None:
        super().__init__(**{k: v for k, v in kwargs.items() if k in ("weight", "enabled")})

    async def evaluate(self, interaction, ctx):
        return 0.0


def test_a_misspelt_scorer_argument_names_the_closest_one():
    entry = {"path": "examples.prm.scorers.LengthBudgetScorer", "kwargs": {"max_output_token": 64}}
    with pytest.raises(ScorerArgumentError) as info:
        build_scorer(entry, allowed_prefixes=ALLOWED)
    assert str(info.value) == (
        "scorer 'examples.prm.scorers.LengthBudgetScorer': kwargs: LengthBudgetScorer got an unexpected "
        "keyword argument `max_output_token`; did you mean `max_output_tokens`?"
    )
    assert isinstance(info.value, ConfigError) and isinstance(info.value, TypeError)  # TypeError: as AReaL's


def test_arguments_handed_up_through_kwargs_are_known():
    check_scorer_kwargs(_Forwards, {"scale": 2.0, "threshold": 0.5}, "here")
    with pytest.raises(ScorerArgumentError, match="`treshold`; did you mean `threshold`"):
        check_scorer_kwargs(_Forwards, {"treshold": 0.5}, "here")
    with pytest.raises(ScorerArgumentError, match="`base_ulr`; did you mean `base_url`"):  # the judge: 3 levels
        build_scorer(_judge_entry(base_ulr=URL), allowed_prefixes=ALLOWED)
    check_scorer_kwargs(_Open, {"anything": 1}, "here")  # its own **kwargs: the constructor decides
    with pytest.raises(ScorerArgumentError, match="`weigth`; did you mean `weight`"):  # but a near-miss is a typo
        check_scorer_kwargs(_Open, {"weigth": 1}, "here")


def test_a_missing_required_argument_and_weight_inside_kwargs_are_named():
    with pytest.raises(ScorerArgumentError, match="here: kwargs: _NeedsThreshold needs `threshold`"):
        check_scorer_kwargs(_NeedsThreshold, {}, "here")
    with pytest.raises(ScorerArgumentError, match=r"set \['weight'\] at the entry level"):
        check_scorer_kwargs(_NeedsThreshold, {"threshold": 1, "weight": 2}, "here")


def test_check_scorer_entries_resolves_without_building_and_names_the_entry(monkeypatch):
    built = []
    monkeypatch.setattr(_NeedsThreshold, "__init__", lambda *a, **k: built.append(k))
    prm = PRMConfig(
        scorers=[
            PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", weight=0.5, kwargs={"max_output_tokens": 9}),
            PRMScorerConfig("scoring_workers.scorers.OpenClawJudgeScorer", enabled=False, kwargs={"base_url": URL}),
        ]
    )
    first, second = check_scorer_entries(prm, allowed_prefixes=ALLOWED)
    assert (first.target, first.weight, first.enabled) == (
        "scoring_workers.scorers.length_budget.LengthBudgetScorer",
        0.5,
        True,
    )
    assert second.cls.__name__ == "OpenClawJudgeScorer" and not second.enabled
    assert registered_limits(URL) is None and not built  # nothing was constructed
    bad = PRMConfig(
        scorers=[prm.scorers[0], PRMScorerConfig("examples.prm.scorers.LengthBudgetScorer", kwargs={"budget": 1})]
    )
    with pytest.raises(ScorerArgumentError, match=r"^rollout.agent.prm.scorers\[1\]: kwargs: LengthBudgetScorer"):
        check_scorer_entries(bad, allowed_prefixes=ALLOWED)


def test_an_unimportable_module_is_one_line_with_the_fix():
    prm = PRMConfig(scorers=[PRMScorerConfig("no_such_pkg_zz.scorers.Mine")])
    with pytest.raises(ModuleNotFoundError) as info:
        check_scorer_entries(prm)
    message = str(info.value)
    assert "\n" not in message and info.value.name == "no_such_pkg_zz"
    assert message.startswith(
        "rollout.agent.prm.scorers[0]: scorer path 'no_such_pkg_zz.scorers.Mine': module "
        "'no_such_pkg_zz.scorers' is not importable"
    )
    assert "install the package" in message and "PYTHONPATH" in message
    with pytest.raises(ImportError, match="has no attribute 'LengthBudgetScorr'; did you mean 'LengthBudgetScorer'"):
        resolve_import("scoring_workers.scorers.LengthBudgetScorr", "scorer path")


def test_a_typo_in_areals_example_path_is_answered_with_the_closest_class():
    """``examples.prm.scorers`` is AReaL's example module, provided built in: a misspelt class
    there is named like any other (not allow-list advice, not "module not importable")."""
    prm = PRMConfig(scorers=[PRMScorerConfig("examples.prm.scorers.LengthBudgetScorr")])
    for allowed in (ALLOWED, None):
        with pytest.raises(ImportError) as info:
            check_scorer_entries(prm, allowed_prefixes=allowed)
        message = str(info.value)
        assert "has no attribute 'LengthBudgetScorr'; did you mean 'LengthBudgetScorer'?" in message, message
        assert "allowed" not in message and "not importable" not in message
    with pytest.raises(ImportError, match="it provides \\['LengthBudgetScorer'\\]"):
        resolve_scorer_class("examples.prm.scorers.Nothing_Like_It", allowed_prefixes=ALLOWED)


@pytest.fixture
def _no_examples_modules(monkeypatch):
    """Hide the ``examples*`` modules during the test and drop the ones it imports after it
    (otherwise later tests would see the user's package as importable)."""
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        del sys.modules[name]


def _user_examples(tmp_path, monkeypatch) -> tuple[str, object]:
    """An importable user package ``examples.prm.scorers`` that records being imported."""
    pkg = tmp_path / "examples" / "prm"
    pkg.mkdir(parents=True)
    (tmp_path / "examples" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    marker = tmp_path / "imported"
    (pkg / "scorers.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('yes')\n"
        "from scoring_workers.scorers import LengthBudgetScorer as _B\n"
        "class LengthBudgetScorer(_B):\n    name = 'users_length_budget'\n"
    )
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    return str(pkg / "scorers.py"), marker


@pytest.mark.usefixtures("_no_examples_modules")
def test_a_users_examples_module_outside_the_allow_list_is_refused_not_silently_replaced(tmp_path, monkeypatch):
    where, marker = _user_examples(tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as info:
        resolve_scorer_class("examples.prm.scorers.LengthBudgetScorer", allowed_prefixes=ALLOWED)
    message = str(info.value)
    assert (
        f"your module 'examples.prm.scorers' ({where}) is importable but not under "
        "worker.allowed_scorer_modules ['scoring_workers.scorers']" in message
    )
    assert "add 'examples.prm.scorers' to worker.allowed_scorer_modules" in message
    assert "name 'scoring_workers.scorers.LengthBudgetScorer' to use the built-in" in message
    assert not marker.exists() and "examples.prm.scorers" not in sys.modules  # found, never run
    users = resolve_scorer_class(
        "examples.prm.scorers.LengthBudgetScorer", allowed_prefixes=[*ALLOWED, "examples.prm.scorers"]
    )
    assert users.name == "users_length_budget" and marker.exists()
