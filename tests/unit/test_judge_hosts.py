"""worker.allowed_judge_hosts: parsing, matching, the start-up check and the build-time check."""

from __future__ import annotations

import pytest

from infra.config import ConfigError, PRMConfig, PRMScorerConfig, config_from_mapping
from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.hosts import (
    HostAllowList,
    check_config_judge_hosts,
    check_record_judge_urls,
    config_judge_urls,
    effective_allow_list,
    endpoint_label,
    has_user_info,
    judge_hosts_allowed,
    redact_url,
)
from scoring_workers.judge.limits import registered_limits
from scoring_workers.prm import PRMRunner

OPENCLAW = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"


def _prm(**kwargs) -> PRMConfig:
    return PRMConfig(scorers=[PRMScorerConfig(OPENCLAW, kwargs=kwargs)])


@pytest.mark.parametrize(
    ("url", "label"),
    [
        ("http://judge:30000", "judge:30000"),
        ("https://Judge.Example.com/v1", "judge.example.com:443"),
        ("http://user:secret@judge/tenant/token?key=x", "judge:80"),
        ("http://[::1]:8000/", "[::1]:8000"),
        ("ftp://judge", "invalid"),
    ],
)
def test_endpoint_label_is_host_and_port_only(url: str, label: str) -> None:
    assert endpoint_label(url) == label


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://judge:30000", "http://judge:30000"),
        ("HTTPS://Judge.Example.com/v1", "https://judge.example.com:443"),
        ("http://user:secret@judge/tenant/token?key=x#frag", "http://judge:80"),
        ("http://[::1]:8000/p", "http://[::1]:8000"),
        ("ftp://user:secret@judge/x", "<not an http(s) URL>"),
        ("http://[::1", "<not an http(s) URL>"),
    ],
)
def test_redact_url_is_scheme_host_and_port_only(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_user_info_is_in_the_authority_only() -> None:
    assert has_user_info("http://u:p@judge/") and has_user_info("http://u@judge")
    assert not has_user_info("http://judge/a@b") and not has_user_info("http://judge?x=@")


PROFILE = {"base_url": "http://judge-0:30000/v1", "api_key_env": "JUDGE_KEY", "m": 3}


@pytest.mark.parametrize(
    ("profile", "record", "needle"),
    [
        (
            {},
            {"base_url": "http://mallory:pw@judge-0:30000"},
            "kwargs.base_url: a record's judge URL may not carry user",
        ),
        ({}, {"base_urls": ["http://judge-0", "http://u:p@judge-1"]}, "kwargs.base_urls[1]: a record's judge URL"),
        (
            PROFILE,
            {"base_url": "http://judge-1:30000"},
            "kwargs.base_url: 'http://judge-1:30000' is not one of the "
            "profile's own judge URLs; the profile holds credentials (api_key_env)",
        ),
        (
            {"base_url": "http://judge-0", "headers": {"X-Key": "k"}},
            {"base_urls": ["http://judge-0", "http://judge-1"]},
            "kwargs.base_urls[1]: 'http://judge-1:80' is not one of the profile's own judge URLs",
        ),
        ({"base_url": "http://ops:pw@judge-0"}, {"base_url": "http://judge-1"}, "(user info in its URLs)"),
    ],
)
def test_a_record_cannot_bring_user_info_or_move_a_profiles_credentials(profile, record, needle) -> None:
    with pytest.raises(ConfigError) as info:
        check_record_judge_urls(profile, record, "prm.scorers[0]")
    assert str(info.value).startswith("prm.scorers[0].") and needle in str(info.value), str(info.value)
    assert "pw" not in str(info.value) and "mallory" not in str(info.value)


def test_a_record_may_choose_among_a_profiles_urls_and_point_an_unkeyed_one_anywhere_allowed() -> None:
    check_record_judge_urls(PROFILE, {"base_url": "http://judge-0:30000/"}, "e")  # the profile's own URL
    check_record_judge_urls({"base_url": "http://judge-0:30000"}, {"base_url": "http://judge-1:30000"}, "e")
    check_record_judge_urls({}, {"base_urls": ["http://judge-0", "http://judge-1"], "m": 3}, "e")


def test_allow_list_matching() -> None:
    hosts = HostAllowList(["judge", "teacher:30001", "*.judges.svc.cluster.local", "[::1]:8000", "10.0.0.7"])
    allowed = [
        "http://judge:30000",
        "https://JUDGE/",
        "http://teacher:30001",
        "http://a.judges.svc.cluster.local:1",
        "http://b.c.judges.svc.cluster.local",
        "http://[::1]:8000",
        "http://10.0.0.7:9",
    ]
    refused = [
        "http://judge.evil.com",
        "http://teacher:30002",
        "http://judges.svc.cluster.local",
        "http://xjudges.svc.cluster.local",
        "http://[::1]:8001",
        "http://evil.com/judge",
        "http://10.0.0.8",
        "not a url",
    ]
    assert [u for u in allowed if not hosts.allows(u)] == []
    assert [u for u in refused if hosts.allows(u)] == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("http://judge:30000", "not a host; write the host"),
        ("judge/v1", "not a host"),
        ("judge:0", "port must be"),
        ("judge:http", "port must be"),
        ("ju dge", "not a host name"),
        ("a.*.com", "not a host name"),
        ("*", "not a host name"),
        ("[::1", "unclosed"),
        ("", "entries must be host names"),
        (3, "entries must be host names"),
    ],
)
def test_bad_entries_are_one_line_errors(entry, message) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        HostAllowList([entry])
    assert "\n" not in str(info.value)


def test_a_string_is_not_a_list() -> None:
    with pytest.raises(ConfigError, match="must be a list"):
        HostAllowList("judge")


def test_config_urls_are_found_under_any_kwarg() -> None:
    prm = PRMConfig(
        scorers=[
            PRMScorerConfig(OPENCLAW, kwargs={"base_urls": ["http://a:1", "http://b:2"], "model": "m"}),
            PRMScorerConfig("my.Scorer", kwargs={"endpoints": {"main": "https://c"}, "note": "see http docs"}),
        ]
    )
    assert config_judge_urls(prm) == [
        ("rollout.agent.prm.scorers[0].kwargs.base_urls[0]", "http://a:1"),
        ("rollout.agent.prm.scorers[0].kwargs.base_urls[1]", "http://b:2"),
        ("rollout.agent.prm.scorers[1].kwargs.endpoints.main", "https://c"),
    ]


def test_default_allows_what_the_file_names_and_nothing_else() -> None:
    prm = _prm(base_urls=["http://judge-0:30000", "http://judge-1:30000/v1"])
    check_config_judge_hosts(prm, None)  # the operator's file: nothing to refuse
    effective = effective_allow_list(prm, None)  # what e.g. a registry record could use
    assert effective.allows("http://judge-1:30000") and not effective.allows("http://judge-1:30001")
    assert not effective.allows("http://elsewhere:30000")
    assert effective_allow_list(prm, ["x"]).allows("http://x:1")


def test_an_explicit_list_refuses_a_config_url_in_one_line() -> None:
    prm = _prm(base_urls=["http://judge-0:30000", "http://user:pw@evil.example:80/path/token"])
    check_config_judge_hosts(prm, ["judge-0", "evil.example:80"])
    with pytest.raises(ConfigError) as info:
        check_config_judge_hosts(prm, ["judge-0"])
    message = str(info.value)
    assert message.startswith("rollout.agent.prm.scorers[0].kwargs.base_urls[1]: judge URL")
    assert "'evil.example:80' is not in worker.allowed_judge_hosts ['judge-0']" in message
    assert "\n" not in message and "token" not in message and "pw" not in message


def test_clients_are_refused_inside_the_allow_list_context() -> None:
    with judge_hosts_allowed(["judge-0"]):
        client = JudgeClient("http://judge-0:30000")
        client.discard()
        with pytest.raises(ConfigError, match="'other:30000' is not in worker.allowed_judge_hosts"):
            JudgeClient(["http://judge-0:30000", "http://other:30000"])
    assert registered_limits("http://judge-0:30000") is None  # the refused pool registered nothing
    JudgeClient("http://other:30000").discard()  # outside the context: no list, no check


async def test_runner_built_under_the_list_refuses_the_scorer() -> None:
    with judge_hosts_allowed(["judge-0"]), pytest.raises(ConfigError, match="worker.allowed_judge_hosts"):
        await PRMRunner.create({"scorers": [{"path": OPENCLAW, "kwargs": {"base_url": "http://judge-9:30000"}}]})
    assert registered_limits("http://judge-9:30000") is None


def test_the_worker_setting_loads_from_yaml_and_environment() -> None:
    cfg = config_from_mapping({"worker": {"allowed_judge_hosts": ["judge", "*.judges.svc"]}}, environ={})
    assert cfg.worker.allowed_judge_hosts == ["judge", "*.judges.svc"]
    assert config_from_mapping({}, environ={}).worker.allowed_judge_hosts is None
    env = {"PRM_WORKER_ALLOWED_JUDGE_HOSTS": "[judge-a, 'judge-b:30000']"}
    assert config_from_mapping({}, environ=env).worker.allowed_judge_hosts == ["judge-a", "judge-b:30000"]
