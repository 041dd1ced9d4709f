"""Experiments that share a judge stay apart, and the operator's judge credentials stay bound.

Real broker, real Redis, an in-process worker, the fake judge; experiments are declared
through the registry topic as ``prm-pipeline experiment add`` writes them.

* **Shared judges are fair.** The endpoint's pacing, concurrency cap and circuit breaker
  are the operator's; what a record sets bounds only its own experiment's calls: a record
  with a tiny ``rps`` does not slow another experiment on the same judge, and one whose
  tiny ``timeout_s`` fails every call opens only its own breaker.
* **Credentials stay bound.** A record naming an operator profile that holds a key cannot
  point the profile at another (allowed) judge; a record URL with user info is refused;
  a judge URL's user info and path never reach a verdict reason or a log line.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from infra.config import PipelineConfig, PRMScorerConfig
from infra.local import free_port
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from prm_pipeline.demo.synthetic import make_group
from tests.integration.harness import running_worker, wait_for_verdicts, with_scorers
from tests.integration.test_fleet import LENGTH, _declare, _publish, _serving, _spec, _verdicts
from tests.polling import poll_until

pytestmark = pytest.mark.integration

OPENCLAW = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"
JUDGE = {
    "model": "fake",
    "temperature": 0.0,
    "m": 1,
    "adaptive": False,
    "max_retries": 0,
    "on_all_votes_failed": "reject",
}


def _judge(url: str, **kwargs) -> PRMScorerConfig:
    return PRMScorerConfig(OPENCLAW, kwargs={"base_url": url, **JUDGE, **kwargs})


def _cfg(pipeline_config: PipelineConfig, **worker) -> PipelineConfig:
    return with_scorers(
        pipeline_config,
        LENGTH,
        allowed_judge_hosts=["127.0.0.1"],
        allowed_scorer_modules=["scoring_workers.scorers", "examples.prm"],
        **worker,
    )


async def _scored(cfg: PipelineConfig, experiment_id: str, n: int, timeout_s: float = 60) -> dict:
    groups = {f"{experiment_id}-{uuid.uuid4().hex[:6]}" for _ in range(n)}
    for gid in groups:
        await _publish(cfg, experiment_id, make_group(gid, 2, turns=2, output_tokens=8))
    return await _verdicts(cfg, experiment_id, groups, timeout_s=timeout_s)


def _refused(worker) -> float:
    return worker.telemetry.registry_records.labels("refused")._value.get()


async def _refused_after(worker, before: float, timeout_s: float = 15) -> None:
    held = (await poll_until(lambda: _refused(worker) > before, timeout_s=timeout_s)).held
    assert held, "the record was not refused"


# --------------------------------------------------------------------------- shared judges
async def test_a_tiny_rps_of_one_experiment_does_not_slow_another(pipeline_config) -> None:
    cfg = _cfg(pipeline_config)
    with FakeJudgeServer() as judge:
        async with running_worker(cfg, "w-fair-rps") as worker:
            # B first: on a worker where the first registrant set the endpoint's pacing, B's 0.01 req/s
            # would be everyone's, and A's calls would find no slot before their deadline
            await _declare(cfg, _spec("exp-slow", _judge(judge.base_url, rps=0.01, total_timeout_s=5.0)))
            await _serving(worker, "exp-slow")
            await _declare(cfg, _spec("exp-fast", _judge(judge.base_url)))
            await _serving(worker, "exp-fast")
            slow = await _scored(cfg, "exp-slow", 1)
            fast = await _scored(cfg, "exp-fast", 3)
    # at B's 0.01 req/s, A's calls would find no slot before their deadline and its groups would be rejected
    assert [v.status for v in fast.values()] == ["accepted"] * 3, [v.reason for v in fast.values()]
    # B's own pacing holds B: its second call in 100 s does not fit its 5 s budget
    assert [v.status for v in slow.values()] == ["rejected"], [v.reason for v in slow.values()]
    assert "rate limit (0.01 req/s)" in next(iter(slow.values())).reason


async def test_a_tiny_timeout_of_one_experiment_opens_only_its_own_breaker(pipeline_config) -> None:
    cfg = _cfg(pipeline_config)
    with FakeJudgeServer(latency_ms=300) as judge:
        async with running_worker(cfg, "w-fair-breaker") as worker:
            await _declare(cfg, _spec("exp-hasty", _judge(judge.base_url, timeout_s=0.1)))
            await _declare(cfg, _spec("exp-patient", _judge(judge.base_url)))
            await _serving(worker, "exp-hasty")
            await _serving(worker, "exp-patient")
            timed_out = await _scored(cfg, "exp-hasty", 6)  # 6+ calls, all timed out: over the threshold (5)
            refused = await _scored(cfg, "exp-hasty", 1)  # so its breaker is open now
            patient = await _scored(cfg, "exp-patient", 2)
    assert {v.status for v in timed_out.values()} == {"rejected"}
    (reason,) = [v.reason for v in refused.values()]
    assert "circuit breaker open" in reason and "no answer within 0.1s" in reason, reason
    assert [v.status for v in patient.values()] == ["accepted"] * 2, [v.reason for v in patient.values()]


# --------------------------------------------------------------------------- credentials
async def test_a_record_cannot_send_a_profiles_key_elsewhere_nor_bring_user_info(
    pipeline_config, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PRM_TEST_JUDGE_KEY", "operator-key-0042")
    with FakeJudgeServer() as ours, FakeJudgeServer() as other:
        profile = _judge(ours.base_url, api_key_env="PRM_TEST_JUDGE_KEY")
        cfg = _cfg(pipeline_config, scorer_profiles={"judge-prod": profile})
        caplog.set_level(logging.INFO)
        async with running_worker(cfg, "w-creds") as worker:
            refused = _refused(worker)
            # another allowed judge, through the key-holding profile: on the old code the key went there
            await _declare(
                cfg, _spec("exp-repoint", PRMScorerConfig(profile="judge-prod", kwargs={"base_url": other.base_url}))
            )
            await _refused_after(worker, refused)
            # user info of the record's choosing would become an Authorization header
            userinfo = other.base_url.replace("http://", "http://mallory:pw-0042@")
            await _declare(cfg, _spec("exp-userinfo", _judge(userinfo)))
            await _refused_after(worker, refused + 1)
            # the profile as the operator pointed it (tuned, not re-pointed) is served
            await _declare(cfg, _spec("exp-tuned", PRMScorerConfig(profile="judge-prod", kwargs={"m": 1})))
            await _serving(worker, "exp-tuned")
            tuned = await _scored(cfg, "exp-tuned", 1)
            assert worker.fleet.get("exp-repoint") is None and worker.fleet.get("exp-userinfo") is None
    assert [v.status for v in tuned.values()] == ["accepted"]
    assert ours.requests > 0 and other.requests == 0
    text = caplog.text
    assert "is not one of the profile's own judge URLs" in text and "may not carry user info" in text
    assert "pw-0042" not in text and "mallory" not in text


async def test_a_judge_urls_user_info_and_path_stay_out_of_verdicts_and_logs(
    pipeline_config, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens: every call fails, and the error names the judge
    url = f"http://ops:hunter2@127.0.0.1:{port}/t0ken-s3cret?key=q5ecret"
    cfg = with_scorers(pipeline_config, _judge(url))
    caplog.set_level(logging.DEBUG)
    gid = f"redact-{uuid.uuid4().hex[:6]}"
    async with running_worker(cfg, "w-redact"):
        await _publish(cfg, None, make_group(gid, 2, turns=2, output_tokens=8))
        (verdict,) = [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=60) if v.group_id == gid]
    shown = f"http://127.0.0.1:{port}"
    rendered = [verdict.reason, *(s.error or "" for s in verdict.sessions), caplog.text]
    assert verdict.status == "rejected" and f"POST {shown}: cannot connect" in verdict.reason, verdict.reason
    assert shown in caplog.text
    for text in rendered:
        for secret in ("hunter2", "ops:", "t0ken", "s3cret", "q5ecret"):
            assert secret not in text, (secret, text[:2000])
