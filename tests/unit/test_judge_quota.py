"""Judge quotas per experiment (``judge_quota``) against the fake judge over real HTTP.

Assertions are on counters and on the order in which calls finish, never on how fast
something was (only lower bounds that pacing guarantees).
"""

from __future__ import annotations

import asyncio

import pytest

from prm_pipeline.demo.fake_judge import FakeJudgeServer
from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.errors import JudgeRequestError, JudgeTimeoutError
from scoring_workers.judge.limits import JudgeQuota, active_quota, all_quotas, judge_quota, registered_limits
from scoring_workers.judge.settings import ClientSettings
from scoring_workers.judge_metrics import JudgeCollector
from scoring_workers.scorers.openclaw import OpenClawJudgeScorer
from tests.polling import eventually

PAYLOAD = {"model": "judge", "messages": [{"role": "user", "content": "## Next state [role: user]\nthanks, ok!"}]}
PATH = "/v1/chat/completions"


def _client(url: str | list[str], quota: JudgeQuota | None, **flat) -> JudgeClient:
    with judge_quota(quota):
        return JudgeClient(url, ClientSettings.from_flat(flat))


async def _calls(client: JudgeClient, n: int, done: list[str] | None = None, tag: str = "") -> None:
    async def one() -> None:
        await client.post_json(PATH, PAYLOAD)
        if done is not None:
            done.append(tag)

    await asyncio.gather(*(one() for _ in range(n)))


# --------------------------------------------------------------------------- the API
def test_quota_validation():
    with pytest.raises(ValueError, match="scope"):
        JudgeQuota("")
    with pytest.raises(ValueError, match="max_in_flight"):
        JudgeQuota("e", max_in_flight=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        JudgeQuota("e", max_in_flight=True)
    with pytest.raises(ValueError, match="rps"):
        JudgeQuota("e", rps=0)
    with pytest.raises(ValueError, match="rps"):
        JudgeQuota("e", rps=float("inf"))
    with pytest.raises(TypeError):
        with judge_quota("e"):  # type: ignore[arg-type]
            pass


def test_the_context_sets_and_restores_the_quota():
    outer, inner = JudgeQuota("ctx-a", max_in_flight=2), JudgeQuota("ctx-b", rps=5)
    assert active_quota() is None
    with judge_quota(outer):
        assert active_quota() is outer
        with judge_quota(inner):
            assert active_quota() is inner
        with judge_quota(None):
            assert active_quota() is None
        assert active_quota() is outer
    assert active_quota() is None


async def test_no_quota_active_means_no_quota_taken():
    with FakeJudgeServer() as srv:
        before = len(all_quotas())
        plain = JudgeClient(srv.base_url)
        unlimited = _client(srv.base_url, JudgeQuota("nothing-to-limit"))  # neither cap nor pacing
        async with plain, unlimited:
            assert plain.quota is None and plain.endpoint_quotas == (None,)
            assert unlimited.endpoint_quotas == (None,)
            assert len(all_quotas()) == before
            await _calls(plain, 3)
            await _calls(unlimited, 3)
            assert plain.stats.succeeded == 3 and unlimited.stats.succeeded == 3


async def test_clients_of_one_scope_share_its_quota_per_endpoint_and_release_it():
    with FakeJudgeServer() as a, FakeJudgeServer() as b:
        quota = JudgeQuota("share", max_in_flight=1)
        first = _client([a.base_url, b.base_url], quota)
        second = _client(a.base_url, quota)
        try:
            qa, qb = first.endpoint_quotas
            assert qa is not None and qb is not None and qa is not qb  # one quota per endpoint of the pool
            assert second.endpoint_quotas == (qa,) and qa.refs == 2 and qb.refs == 1
            redeclared = _client(a.base_url, JudgeQuota("share", max_in_flight=5))  # the experiment re-declared
            (qn,) = redeclared.endpoint_quotas
            assert qn is not qa and qn.quota.max_in_flight == 5  # new clients take the new quota ...
            assert qa.refs == 2 and qa.quota.max_in_flight == 1  # ... open ones keep theirs until they close
            redeclared.discard()
        finally:
            first.discard()
            second.discard()
        assert not [q for q in all_quotas() if q.scope == "share"]


# --------------------------------------------------------------------------- caps
async def test_a_scope_over_its_in_flight_quota_waits_and_another_scope_does_not():
    with FakeJudgeServer(latency_ms=100) as srv:
        capped = _client(srv.base_url, JudgeQuota("exp-a", max_in_flight=1), max_concurrency=32)
        free = _client(srv.base_url, JudgeQuota("exp-b", max_in_flight=50), max_concurrency=32)
        async with capped, free:
            await asyncio.gather(_calls(capped, 5), _calls(free, 8))
            qa, qb = capped.endpoint_quotas[0], free.endpoint_quotas[0]
            assert qa is not None and qb is not None
            assert qa.peak_in_flight == 1 and qa.admitted == 5 and qa.waited == 4 and qa.wait_s > 0
            assert qb.peak_in_flight == 8 and qb.waited == 0
            assert capped.limits.max_in_flight >= 8  # B's calls ran side by side with A's one
            assert capped.stats.succeeded == 5 and free.stats.succeeded == 8


async def test_a_call_waiting_for_its_quota_holds_no_process_wide_slot():
    # Process-wide cap 2. Experiment A (quota 1) queues 4 calls first, then B sends 2.
    # A's queued calls wait in the quota, not in the process-wide semaphore, so B gets
    # the second slot at once and finishes its first call long before A's last one.
    with FakeJudgeServer(latency_ms=100) as srv:
        a = _client(srv.base_url, JudgeQuota("slot-a", max_in_flight=1), max_concurrency=2)
        b = _client(srv.base_url, JudgeQuota("slot-b", max_in_flight=2), max_concurrency=2)
        done: list[str] = []
        async with a, b:
            a_calls = asyncio.ensure_future(_calls(a, 4, done, "a"))
            await eventually(
                lambda: a.limits.in_flight == 1, timeout_s=5, interval_s=0.005, what="one of A's calls in flight"
            )
            assert a.limits.load == 1  # the 3 waiting for A's quota add no load on the endpoint
            await asyncio.gather(a_calls, _calls(b, 2, done, "b"))
        assert done.index("b") < done.index("a", 2), done  # old order: B only after all of A's


async def test_quota_wait_counts_against_the_deadline():
    with FakeJudgeServer(latency_ms=600) as srv:
        client = _client(srv.base_url, JudgeQuota("slow", max_in_flight=1), total_timeout_s=10, timeout_s=5)
        async with client:
            first = asyncio.ensure_future(client.post_json(PATH, PAYLOAD))
            await eventually(
                lambda: client.limits.in_flight == 1, timeout_s=5, interval_s=0.005, what="the first call in flight"
            )
            deadline = asyncio.get_running_loop().time() + 0.2
            with pytest.raises(JudgeTimeoutError, match="experiment 'slow' has no free judge slot"):
                await client.post_json(PATH, PAYLOAD, deadline=deadline)
            await first  # the call holding the quota is not disturbed
        quota = client.endpoint_quotas[0]
        assert quota is not None and quota.waited == 1 and quota.admitted == 1 and quota.in_flight == 0


# --------------------------------------------------------------------------- pacing
async def test_rps_pacing_is_per_scope():
    # Two experiments at 10 calls/s each, 3 calls each, at the same time: each waits for
    # its own pacer only (2 waits each; one shared pacer would make 5 of the 6 wait).
    with FakeJudgeServer() as srv:
        a = _client(srv.base_url, JudgeQuota("pace-a", rps=10))
        b = _client(srv.base_url, JudgeQuota("pace-b", rps=10))
        async with a, b:
            loop = asyncio.get_running_loop()
            start = loop.time()
            await _calls(a, 3)
            elapsed = loop.time() - start
            await asyncio.gather(_calls(a, 3), _calls(b, 3))
        qa, qb = a.endpoint_quotas[0], b.endpoint_quotas[0]
        assert qa is not None and qb is not None
        assert elapsed >= 0.2 - 0.01  # 3 calls 100 ms apart
        assert qa.admitted == 6 and qb.admitted == 3 and qb.waited == 2
        assert qa.waited >= 2 + 2  # the second batch waited for A's pacer, not for B's calls


# --------------------------------------------------------------------------- release
async def test_quota_released_after_an_error():
    with FakeJudgeServer() as srv:
        srv.fail_next(400, 1)
        client = _client(srv.base_url, JudgeQuota("err", max_in_flight=1))
        async with client:
            with pytest.raises(JudgeRequestError):
                await client.post_json(PATH, PAYLOAD)
            quota = client.endpoint_quotas[0]
            assert quota is not None and quota.in_flight == 0
            await client.post_json(PATH, PAYLOAD)  # the slot is free again
            assert quota.waited == 0 and quota.admitted == 2


async def test_quota_released_on_cancel_while_on_the_wire_and_while_waiting():
    with FakeJudgeServer(latency_ms=5000) as srv:
        client = _client(srv.base_url, JudgeQuota("cancel", max_in_flight=1), total_timeout_s=30, timeout_s=30)
        async with client:
            quota = client.endpoint_quotas[0]
            assert quota is not None
            on_wire = asyncio.ensure_future(client.post_json(PATH, PAYLOAD))
            waiting = asyncio.ensure_future(client.post_json(PATH, PAYLOAD))
            await eventually(
                lambda: client.limits.in_flight == 1 and quota.in_flight == 1,
                timeout_s=5,
                interval_s=0.005,
                what="one call on the wire, holding the quota",
            )
            waiting.cancel()
            on_wire.cancel()
            for task in (waiting, on_wire):
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert quota.in_flight == 0 and client.limits.in_flight == 0
            semaphore = quota.gate(asyncio.get_running_loop()).semaphore
            assert semaphore is not None and not semaphore.locked()


# --------------------------------------------------------------------------- scorers and metrics
async def test_a_scorer_built_in_the_context_takes_the_quota_and_metrics_name_the_scope():
    with FakeJudgeServer() as srv:
        quota = JudgeQuota("exp-metrics", max_in_flight=1)
        with judge_quota(quota):
            scorer = OpenClawJudgeScorer(base_url=srv.base_url, model="judge")
        try:
            assert scorer.client.quota == quota
            await asyncio.gather(*(scorer.client.post_json(PATH, PAYLOAD) for _ in range(3)))
            samples = {
                (s.name, s.labels.get("scope")): s.value
                for family in JudgeCollector().collect()
                for s in family.samples
            }
        finally:
            await scorer.aclose()
        assert samples[("prm_judge_quota_admitted_total", "exp-metrics")] == 3
        assert samples[("prm_judge_quota_waited_total", "exp-metrics")] == 2
        assert samples[("prm_judge_quota_wait_seconds_total", "exp-metrics")] > 0
        assert not [q for q in all_quotas() if q.scope == "exp-metrics"]  # closed: released


# --------------------------------------------------------------------------- tenants
async def test_a_tenant_sets_no_process_wide_limit_and_its_own_limits_bind_only_its_calls():
    """The first registrant of an endpoint used to set its pacing for the whole process: a
    tenant's 0.5 req/s would have been everyone's (or refused as a clash)."""
    with FakeJudgeServer() as srv:
        operator = _client(srv.base_url, None, max_concurrency=8)
        slow = _client(srv.base_url, JudgeQuota("t-slow"), rps=0.5, max_concurrency=1, breaker_failure_threshold=1)
        fast = _client(srv.base_url, JudgeQuota("t-fast"))
        try:
            shared = registered_limits(srv.base_url)
            assert shared is not None and (shared.settings.max_concurrency, shared.settings.rps) == (8, 0.0)
            assert shared.breaker.failure_threshold == 5  # the operator's (default), not the tenant's 1
            slowed = asyncio.create_task(_calls(slow, 2))  # its second call waits 2 s for its own pacing
            await eventually(
                lambda: srv.requests == 1, timeout_s=5, interval_s=0.005, what="the slow tenant's first call"
            )
            await _calls(fast, 5)  # unpaced: done while the slow tenant still waits
            assert not slowed.done() and srv.requests == 6
            (own,) = [ep.own for ep in fast._endpoints]
            assert own is not None and own.waited == 0 and shared.waited == 0
            await slowed
            assert slow._endpoints[0].own.waited == 1
        finally:
            for c in (operator, slow, fast):
                await c.aclose()


async def test_a_tenants_failures_open_only_its_own_breaker():
    """A tenant whose tiny timeout fails every call used to open the endpoint's breaker for everyone."""
    with FakeJudgeServer(latency_ms=200) as srv:
        operator = _client(srv.base_url, None)
        hasty = _client(srv.base_url, JudgeQuota("t-hasty"), timeout_s=0.02, max_retries=0)
        patient = _client(srv.base_url, JudgeQuota("t-patient"))
        try:
            for _ in range(5):
                with pytest.raises(JudgeTimeoutError):
                    await hasty.post_json(PATH, PAYLOAD)
            assert hasty.breaker.state == "open"
            assert hasty.breaker is not patient.breaker and hasty.breaker is not operator.breaker
            assert await patient.post_json(PATH, PAYLOAD) and await operator.post_json(PATH, PAYLOAD)
            assert patient.breaker.state == operator.breaker.state == "closed"
            assert registered_limits(srv.base_url).failed_attempts == 5  # the endpoint's metrics still count them
        finally:
            for c in (operator, hasty, patient):
                await c.aclose()
