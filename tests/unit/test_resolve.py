"""One import resolver for everything a config names, enforcing worker.allowed_scorer_modules."""

from __future__ import annotations

import pytest

from infra.config import ConfigError
from scoring_workers.prm.resolve import allowed_modules, build_scorer, resolve_callable, resolve_import
from scoring_workers.scorers.judge_limits import registered_limits

ALLOWED = ["scoring_workers.scorers"]
URL = "http://127.0.0.1:9"  # never contacted: constructors make no request


def _judge_entry(**kwargs) -> dict:
    return {"path": "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
            "kwargs": {"base_url": URL, **kwargs}}


@pytest.mark.parametrize("setting", ["chat_template", "audit_sink"])
def test_judge_callables_named_in_config_obey_the_allow_list(setting):
    # Before: the judge resolved these with its own importer and imported os.getcwd happily.
    with pytest.raises(ConfigError, match=rf"{setting} 'os:getcwd' is refused: module 'os' is not under "
                                          r"the allowed prefixes \['scoring_workers.scorers'\]"):
        build_scorer(_judge_entry(**{setting: "os:getcwd"}), allowed_prefixes=ALLOWED)
    assert registered_limits(URL) is None  # the failed constructor released its client


def test_opd_tokenizer_named_in_config_obeys_the_allow_list():
    entry = {"path": "scoring_workers.scorers.opd.OPDTeacherScorer",
             "kwargs": {"base_url": URL, "tokenizer": "os.path.basename"}}
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
