"""The judge pool: routing (pure), and the pool client and scorers against real fake judges over HTTP.

Routing is checked on plain numbers (:func:`choose_endpoint`); the pool's behaviour —
affinity, spill-over from a slow replica, breaker-open replicas skipped, failover that
keeps every vote — against in-process :class:`FakeJudgeServer` replicas on loopback.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter

import pytest

from prm_pipeline.demo.fake_judge import FakeJudgeServer
from scoring_workers.judge.apis import openai_chat
from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.errors import CircuitOpenError
from scoring_workers.judge.limits import registered_limits
from scoring_workers.judge.pool import SpillPolicy, choose_endpoint, rendezvous_order
from scoring_workers.judge.settings import ClientSettings, ModelSettings
from scoring_workers.judge_metrics import JudgeCollector
from scoring_workers.scorers.opd import OPDTeacherScorer
from scoring_workers.scorers.openclaw import OpenClawJudgeScorer
from tests.unit.test_judge_scorers import char_tokenizer, ctx_for, obs, three_turns

PROMPT = [{"role": "user", "content": "## Next state [role: user]\nthanks, ok!"}]
MARGIN_S = 0.5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def replicas():
    servers = [FakeJudgeServer() for _ in range(3)]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


def _pool(urls, **flat) -> JudgeClient:
    flat.setdefault("backoff_base_s", 0.001)
    flat.setdefault("backoff_max_s", 0.01)
    return JudgeClient(list(urls), ClientSettings.from_flat(flat), rng=random.Random(0))


MODEL = ModelSettings(model="judge", temperature=0.6, max_tokens=64)


async def _chat(client: JudgeClient, key: str | None) -> str:
    return await openai_chat(client, PROMPT, MODEL, affinity=key)


def _key_preferring(urls: list[str], index: int, prefix: str = "s") -> str:
    """A session id whose rendezvous ranking puts ``urls[index]`` first."""
    for i in range(10_000):
        key = f"{prefix}-{i}"
        if rendezvous_order(key, urls)[0] == index:
            return key
    raise AssertionError("no key found")


# --------------------------------------------------------------------------- routing, pure
def test_rendezvous_is_a_stable_spread_permutation() -> None:
    urls = [f"http://judge-{i}:30000" for i in range(3)]
    firsts = Counter(rendezvous_order(f"session-{k}", urls)[0] for k in range(3000))
    assert all(800 < firsts[i] < 1200 for i in range(3)), firsts  # about a third each
    order = rendezvous_order("session-7", urls)
    assert sorted(order) == [0, 1, 2] and rendezvous_order("session-7", urls) == order
    # Removing a replica moves only the sessions that ranked it first; the others keep theirs.
    fewer = urls[:2]
    for k in range(500):
        full = rendezvous_order(f"session-{k}", urls)
        if full[0] != 2:
            assert fewer[rendezvous_order(f"session-{k}", fewer)[0]] == urls[full[0]]


def test_affinity_share_when_no_endpoint_is_overloaded() -> None:
    """Random loads that never differ by more than the spill threshold: every call of a
    session goes to its first-ranked replica (share 1.0, the goal is >= 0.95)."""
    rng = random.Random(1)
    urls = [f"http://judge-{i}:30000" for i in range(3)]
    policy = SpillPolicy()
    hits = calls = 0
    for k in range(300):
        order = rendezvous_order(f"s-{k}", urls)
        for _ in range(10):
            base = rng.randint(0, 40)
            loads = [base + rng.randint(0, policy.spill_in_flight) for _ in urls]
            index, route = choose_endpoint(loads, [True] * 3, order=order, policy=policy, caps=[64] * 3)
            calls += 1
            hits += index == order[0]
            assert route == "affinity"
    assert hits / calls >= 0.95


def test_spill_over_needs_both_thresholds() -> None:
    policy = SpillPolicy(spill_in_flight=8, spill_ratio=1.5)
    order = (0, 1, 2)
    avail = [True] * 3
    assert choose_endpoint([20, 0, 3], avail, order=order, policy=policy) == (1, "spill")  # least-loaded
    assert choose_endpoint([8, 0, 0], avail, order=order, policy=policy) == (0, "affinity")  # excess 8: not > 8
    assert choose_endpoint([30, 25, 25], avail, order=order, policy=policy) == (0, "affinity")  # excess 5
    assert choose_endpoint([36, 25, 25], avail, order=order, policy=policy) == (0, "affinity")  # 36 < 1.5 * 25
    assert choose_endpoint([40, 25, 26], avail, order=order, policy=policy) == (1, "spill")
    # At its concurrency cap while another has room: spill even below the thresholds.
    assert choose_endpoint([4, 0, 0], avail, order=order, policy=policy, caps=[4, 4, 4]) == (1, "spill")
    assert choose_endpoint([4, 4, 4], avail, order=order, policy=policy, caps=[4, 4, 4]) == (0, "affinity")


def test_a_slow_replica_counts_its_load_in_its_own_time() -> None:
    """Costs are (load + 1) x latency: a replica 10x slower keeps a session's call only
    while it has almost nothing in flight, and spilled calls go to the cheapest replica,
    not to the idle slow one."""
    policy = SpillPolicy()  # 16 calls behind, 1.5x
    lat = [0.2, 0.02, 0.02]  # replica 0 is 10x slower
    order = (0, 1, 2)
    avail = [True] * 3
    assert choose_endpoint([0, 0, 0], avail, order=order, policy=policy, latencies=lat) == (0, "affinity")  # 9 behind
    assert choose_endpoint([1, 1, 2], avail, order=order, policy=policy, latencies=lat) == (1, "spill")  # 18 behind
    assert choose_endpoint([0, 3, 2], avail, latencies=lat) == (2, "balanced")  # cost 0.2 vs 0.06
    # With plain in-flight counts the slow replica would have kept its session's call.
    assert choose_endpoint([1, 1, 2], avail, order=order, policy=policy) == (0, "affinity")
    # Not measured yet: as fast as the fastest measured, so it gets calls and is measured.
    assert choose_endpoint([0, 1, 1], avail, order=(0, 1, 2), latencies=[None, 0.02, 0.02]) == (0, "affinity")
    assert choose_endpoint([0, 1, 1], avail, latencies=[None, 0.02, 0.02]) == (0, "balanced")


def test_breaker_open_endpoint_is_skipped_consistently() -> None:
    order = (2, 0, 1)
    assert choose_endpoint([0, 0, 0], [True, True, False], order=order) == (0, "detour")  # the session's next
    assert choose_endpoint([0, 0, 0], [True, True, True], order=order) == (2, "affinity")
    assert choose_endpoint([0, 5, 9], [False, True, False], order=order) == (1, "detour")
    assert choose_endpoint([0, 0, 0], [False, False, False], order=order) is None
    assert choose_endpoint([3, 1, 2], [False, True, True]) == (1, "balanced")  # no key: least-loaded available


def test_failover_avoids_endpoints_that_failed() -> None:
    order = (0, 1, 2)
    assert choose_endpoint([0, 0, 0], [True] * 3, order=order, avoid=[0]) == (1, "failover")
    assert choose_endpoint([0, 0, 0], [True] * 3, order=order, avoid=[0, 1]) == (2, "failover")
    # Every available endpoint failed already: retry among them (the client backs off then).
    assert choose_endpoint([0, 0, 0], [True, True, False], order=order, avoid=[0, 1]) == (0, "affinity")
    assert choose_endpoint([5, 0, 0], [True] * 3, avoid=[1]) == (2, "failover")


def test_balanced_ties_rotate() -> None:
    picks = {choose_endpoint([0, 0, 0], [True] * 3, start=s)[0] for s in range(3)}
    assert picks == {0, 1, 2}


@pytest.mark.parametrize(
    "kwargs", [{"spill_in_flight": -1}, {"spill_ratio": 0.5}, {"spill_ratio": float("inf")}, {"spill_in_flight": True}]
)
def test_spill_policy_is_validated(kwargs) -> None:
    with pytest.raises(ValueError):
        SpillPolicy(**kwargs)


# --------------------------------------------------------------------------- the pool client over HTTP
async def test_a_session_sticks_to_its_replica(replicas) -> None:
    urls = [s.base_url for s in replicas]
    async with _pool(urls) as client:

        async def session(k: int) -> None:
            for _ in range(6):
                await _chat(client, f"sess-{k}")

        for wave in range(3):  # 16 sessions in flight: no replica ever has more than 16 calls more than another
            await asyncio.gather(*(session(wave * 16 + k) for k in range(16)))
        routed = Counter()
        for lim in client.endpoint_limits:
            routed.update(lim.routed)
    served = [s.by_path["/v1/chat/completions"] for s in replicas]
    assert sum(served) == 48 * 6 and all(n > 0 for n in served), served
    assert routed["affinity"] / sum(routed.values()) >= 0.95, routed
    # Each replica served the calls of the sessions that rank it first, but for the few
    # that spilled (a loaded machine can make a replica look busy): each moves one call.
    expected = Counter(rendezvous_order(f"sess-{k}", urls)[0] for k in range(48))
    spilled = sum(routed.values()) - routed["affinity"]
    assert sum(abs(n - expected[i] * 6) for i, n in enumerate(served)) <= 2 * spilled, (served, expected, routed)


async def test_a_slow_replica_spills_its_excess(replicas) -> None:
    slow = replicas[0]
    slow.latency_ms = 150.0
    urls = [s.base_url for s in replicas]
    async with _pool(urls, max_concurrency=64, spill_in_flight=4) as client:

        async def session(k: int) -> None:
            for _ in range(4):
                await _chat(client, f"spill-{k}")

        await asyncio.gather(*(session(k) for k in range(60)))
        spilled = client.endpoint_limits[0].routed  # what was routed *to* the slow one
        to_others = sum(lim.routed["spill"] for lim in client.endpoint_limits[1:])
    prefer_slow = sum(rendezvous_order(f"spill-{k}", urls)[0] == 0 for k in range(60))
    served = [s.by_path["/v1/chat/completions"] for s in replicas]
    assert to_others > 0, spilled
    assert served[0] < prefer_slow * 4, (served, prefer_slow)  # the slow replica shed part of its sessions' calls
    assert sum(served) == 240


async def test_breaker_open_replica_gets_nothing(replicas) -> None:
    a, b, c = replicas
    urls = [s.base_url for s in replicas]
    key = _key_preferring(urls, 0)
    a.set_outage(True)
    async with _pool(urls, max_retries=2, breaker_failure_threshold=1, breaker_reset_s=60) as client:
        assert "\\boxed{1}" in await _chat(client, key)  # A answers 503, the retry goes elsewhere at once
        assert client.endpoint_limits[0].breaker.state == "open"
        assert client.stats.failovers == 1
        a.reset_counters()
        for i in range(20):
            assert "\\boxed{1}" in await _chat(client, key if i % 2 else _key_preferring(urls, 0, f"k{i}"))
        routes = client.endpoint_limits[1].routed + client.endpoint_limits[2].routed
    assert a.requests == 0  # skipped while open: not even a failing attempt
    assert routes["detour"] == 20
    # A detour is consistent: one session's calls all went to its next replica.
    second = rendezvous_order(key, urls)[1]
    assert replicas[second].requests >= 10


async def test_failover_to_another_replica_costs_no_backoff_and_no_call(replicas) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    urls = [dead, replicas[0].base_url]
    key = _key_preferring(urls, 0)
    async with _pool(urls, max_retries=1, backoff_base_s=5.0, backoff_max_s=5.0) as client:
        t0 = time.monotonic()
        assert "\\boxed{1}" in await _chat(client, key)
        assert time.monotonic() - t0 < 2.0  # no 2.5-5 s backoff before moving to the live replica
        assert client.stats.failovers == 1 and client.stats.failed == 0
    assert replicas[0].requests == 1


async def test_a_breaker_that_closes_after_routing_costs_no_retry(replicas) -> None:
    """Routing saw the endpoint admit a call, but by the time the call had its slot
    another call had taken the half-open probe: nothing was sent, so moving to another
    replica uses none of the retry budget (here: none at all)."""
    urls = [replicas[0].base_url, replicas[1].base_url]
    key = _key_preferring(urls, 0)
    async with _pool(urls, max_retries=0) as client:
        breaker = client.endpoint_limits[0].breaker
        breaker.admits = lambda: True  # the state routing saw
        breaker.acquire = lambda: None  # the state at the attempt
        assert "\\boxed{1}" in await _chat(client, key)
        assert (client.stats.retries, client.stats.failovers, client.stats.attempts) == (0, 1, 1)
    assert (replicas[0].requests, replicas[1].requests) == (0, 1)


async def test_a_timeout_fails_over_to_a_faster_replica(replicas) -> None:
    slow, fast = replicas[0], replicas[1]
    slow.latency_ms = 3000.0
    urls = [slow.base_url, fast.base_url]
    key = _key_preferring(urls, 0)
    async with _pool(urls, timeout_s=0.3, total_timeout_s=5.0, max_retries=1) as client:
        t0 = time.monotonic()
        assert "\\boxed{1}" in await _chat(client, key)
        assert time.monotonic() - t0 < 0.3 + MARGIN_S + 0.5
    assert fast.requests == 1


async def test_a_single_server_still_does_not_retry_a_timeout(replicas) -> None:
    replicas[0].latency_ms = 2000.0
    async with _pool([replicas[0].base_url], timeout_s=0.2, max_retries=3) as client:
        with pytest.raises(Exception, match="no answer within"):
            await _chat(client, "s")
    assert replicas[0].requests == 1


async def test_every_breaker_open_fails_fast(replicas) -> None:
    for s in replicas:
        s.set_outage(True)
    urls = [s.base_url for s in replicas]
    async with _pool(urls, max_retries=2, breaker_failure_threshold=1, breaker_reset_s=60) as client:
        with pytest.raises(Exception, match="HTTP 503"):
            await _chat(client, "s")  # three attempts, one per replica, each opening its breaker
        assert [lim.breaker.state for lim in client.endpoint_limits] == ["open"] * 3
        t0 = time.monotonic()
        with pytest.raises(CircuitOpenError, match="every endpoint's circuit breaker is open"):
            await _chat(client, "s")
        assert time.monotonic() - t0 < 0.1
    assert sum(s.requests for s in replicas) == 3


async def test_pool_limits_are_per_endpoint_and_released(replicas) -> None:
    urls = [s.base_url for s in replicas]
    client = _pool(urls, max_concurrency=5)
    assert [registered_limits(u).settings.max_concurrency for u in urls] == [5, 5, 5]
    assert len({id(lim) for lim in client.endpoint_limits}) == 3
    await client.aclose()
    assert all(registered_limits(u) is None for u in urls)


# --------------------------------------------------------------------------- scorers
async def test_failover_keeps_every_vote(replicas) -> None:
    """A replica that fails every request: each vote that lands there is retried on a
    healthy one, so every turn gets all m votes and no vote is an error."""
    failing = FakeJudgeServer(error_rate=1.0)
    failing.start()
    try:
        urls = [failing.base_url, replicas[0].base_url, replicas[1].base_url]
        scorer = OpenClawJudgeScorer(
            base_urls=urls,
            model="fake",
            m=3,
            adaptive=False,
            max_retries=2,
            backoff_base_s=0.001,
            backoff_max_s=0.01,
            breaker_failure_threshold=3,
            breaker_reset_s=60,
        )
        turns = three_turns()
        results = []
        try:
            for k in range(30):
                ctx = {**ctx_for(turns), "session_id": f"fo-{k}"}
                results.append(await scorer.evaluate_result(turns[0], ctx))
            failovers = scorer.client.stats.failovers
        finally:
            await scorer.aclose()
    finally:
        failing.stop()
    assert [obs(r, "judge_calls") for r in results] == [3.0] * 30  # the vote count is kept
    assert all(obs(r, "judge_call_errors") == 0.0 and r.reward == -1.0 for r in results)  # tool error -> -1
    assert failing.statuses[500] == 3 and failovers == 3  # until its breaker opened, each failure moved on
    assert replicas[0].requests + replicas[1].requests == 90


async def test_opd_teacher_pool_keeps_a_session_on_one_teacher(replicas) -> None:
    judge, t1, t2 = replicas
    scorer = OPDTeacherScorer(
        base_url=judge.base_url,
        teacher_base_urls=[t1.base_url, t2.base_url],
        model="fake",
        tokenizer=char_tokenizer,
        max_retries=0,
    )
    turns = three_turns()
    try:
        for k in range(12):
            await scorer.evaluate_result(turns[0], {**ctx_for(turns), "session_id": f"opd-{k}"})
            await scorer.evaluate_result(turns[0], {**ctx_for(turns), "session_id": f"opd-{k}"})
    finally:
        await scorer.aclose()
    assert judge.by_path["/generate"] == 0 and t1.by_path["/generate"] + t2.by_path["/generate"] == 24
    urls = [t1.base_url, t2.base_url]
    expected = Counter(rendezvous_order(f"opd-{k}", urls)[0] for k in range(12))
    assert [t1.by_path["/generate"], t2.by_path["/generate"]] == [2 * expected[0], 2 * expected[1]]


def test_pool_configuration_is_checked(replicas) -> None:
    url = replicas[0].base_url
    with pytest.raises(ValueError, match="not both"):
        OpenClawJudgeScorer(base_url=url, base_urls=[url])
    with pytest.raises(ValueError, match="non-empty list"):
        OpenClawJudgeScorer(base_urls=[])
    with pytest.raises(ValueError, match="non-empty list"):
        OpenClawJudgeScorer(base_urls=url)
    with pytest.raises(ValueError, match="twice"):
        OpenClawJudgeScorer(base_urls=[url, url + "/"])
    with pytest.raises(ValueError, match="a pool goes in base_urls"):
        OpenClawJudgeScorer(base_url=[url])
    with pytest.raises(TypeError, match="needs base_url"):
        OpenClawJudgeScorer()
    with pytest.raises(ValueError, match="spill_ratio"):
        OpenClawJudgeScorer(base_urls=[url, replicas[1].base_url], spill_ratio=0.5)
    with pytest.raises(ValueError, match="teacher_base_url"):
        OPDTeacherScorer(base_url=url, teacher_base_url=url, teacher_base_urls=[url])
    assert registered_limits(url) is None  # nothing leaked by the failed constructors


# --------------------------------------------------------------------------- metrics
def test_metrics_name_endpoints_by_host_and_port_only(replicas) -> None:
    port = replicas[0].base_url.rsplit(":", 1)[1]
    secret = f"http://user:pw@127.0.0.1:{port}/tenant/s3cr3t-token"
    client = JudgeClient([secret, replicas[1].base_url])
    try:
        client.endpoint_limits[1].routed["affinity"] += 3
        samples = [s for family in JudgeCollector().collect() for s in family.samples]
    finally:
        client.discard()
    ours = {f"127.0.0.1:{port}", replicas[1].base_url.removeprefix("http://")}
    labels = {s.labels["endpoint"] for s in samples}
    assert ours <= labels  # other tests' clients may still be registered in this process
    assert all("/" not in label and "@" not in label for label in labels)  # host:port, never a path or login
    assert not any("s3cr3t" in str(s) or "pw" in str(s.labels) for s in samples)
    routed = {
        (s.labels["endpoint"], s.labels["route"]): s.value
        for s in samples
        if s.name == "prm_judge_routed_total" and s.labels["endpoint"] in ours
    }
    assert routed == {(replicas[1].base_url.removeprefix("http://"), "affinity"): 3.0}
