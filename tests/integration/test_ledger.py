"""The group ledger's transitions against real Redis: standalone and Redis Cluster mode.

Cluster mode runs a one-node valkey cluster owning all 16384 slots: enough to prove the
cluster client routes every script by its ``{group_id}`` hash tag (a cross-slot script
would be refused with CROSSSLOT) and that scripts work without pipelines.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import msgspec
import pytest

from infra.config import PRMConfig, RedisConfig
from infra.local import LocalService, find_redis_binary, free_port
from infra.retry import REDIS_OUTAGES
from infra.schema import SessionResult
from prm_pipeline.demo.synthetic import make_session
from scoring_workers import ledger as ledger_module
from scoring_workers.ledger import GroupLedger, ParkRequest
from scoring_workers.prm.runner import PRMRunner
from scoring_workers.scorers.length_budget import LengthBudgetScorer
from scoring_workers.scoring import score_member
from scoring_workers.verdicts import assemble_verdict, encode_scorers
from tests.polling import eventually, wait_until

pytestmark = pytest.mark.integration


def _cluster_cmd(port: int, *args: str) -> bytes:
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(payload.encode())
        return s.recv(4096)


def _cluster_port() -> int:
    """A free port whose cluster-bus twin (port + 10000) is free too: so at most 55535."""
    for _ in range(200):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster-mode Redis")


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("redis-cluster")
    port = _cluster_port()
    svc = LocalService(
        "redis",
        [
            str(find_redis_binary()),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(tmp / "nodes.conf"),
            "--dir",
            str(tmp),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        port,
        tmp / "redis.log",
    )
    svc.start()
    try:
        assert _cluster_cmd(port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383").startswith(b"+OK")
        wait_until(
            lambda: b"cluster_state:ok" in _cluster_cmd(port, "CLUSTER", "INFO"),
            timeout_s=4,
            interval_s=0.02,
            what="the node to report the cluster ready",
        )
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        svc.stop()


@pytest.fixture(params=["standalone", "cluster"])
async def ledger(request, redis_url: str):
    if request.param == "cluster":
        cfg = RedisConfig(url=request.getfixturevalue("cluster_url"), cluster=True, key_prefix="t", ttl_s=60)
    else:
        cfg = RedisConfig(url=redis_url, key_prefix=f"ledger-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    yield led
    await led.aclose()


def _member(tid: str, status: str = "scored") -> SessionResult:
    return SessionResult(session_id=f"s-{tid}", trajectory_id=tid, status=status, outcome_reward=1.0)


ARGS = dict(group_timeout_s=30, worker_id="w1", scorers=encode_scorers([]))


async def test_last_member_decides_once_and_finish_leaves_a_tombstone(ledger) -> None:
    g = f"g-{uuid.uuid4().hex[:6]}"
    assert await ledger.probe_many([(g, "a")]) == ["new"]
    outcome, decision = await ledger.park(_member("a"), group_id=g, group_size=2, **ARGS)
    assert (outcome, decision) == ("parked", None)
    assert await ledger.probe_many([(g, "a"), (g, "b")]) == ["duplicate", "new"]
    outcome, decision = await ledger.park(_member("b"), group_id=g, group_size=2, **ARGS)
    assert outcome == "parked" and decision.outcome == "decided_now"
    verdict = assemble_verdict(g, decision.state, decision.members)
    assert verdict.status == "accepted" and [s.trajectory_id for s in verdict.sessions] == ["a", "b"]
    # a redelivered member finds the decision already made: nobody publishes twice
    outcome, decision = await ledger.park(_member("b"), group_id=g, group_size=2, **ARGS)
    assert outcome == "decided" and decision is None
    again = await ledger.decide(g, "complete", worker_id="w2", scorers=b"\x90", group_timeout_s=30, republish_grace_s=5)
    assert again.outcome == "already_decided" and again.state.decided_by == "w1"
    assert assemble_verdict(g, again.state, again.members) == verdict  # rebuilt byte-identical
    await ledger.finish(g)
    assert await ledger.probe_many([(g, "a"), (g, "c")]) == ["done", "done"]
    assert g not in await ledger.due_groups()


async def test_members_parked_by_the_deciding_call_are_the_stored_ones(ledger) -> None:
    """The deciding park takes the members it just encoded instead of decoding them again:
    they must be exactly what any other reader decodes from Redis (scored members, with
    dense token rewards, turn results and their observations)."""
    g = f"g-{uuid.uuid4().hex[:6]}"
    runner = PRMRunner(PRMConfig(enabled=True, scorers=[LengthBudgetScorer(max_output_tokens=12)]))
    results = [
        await score_member(
            runner,
            make_session(trajectory_id=t, session_id=f"s-{t}", group_id=g, group_size=2, turns=5, branch_at=2),
            timeout_s=None,
        )
        for t in ("a", "b")
    ]
    assert all(r.status == "scored" and r.turn_results for r in results)
    ((_, none), (outcome, decision)) = await ledger.park_many(
        [ParkRequest(r, g, 2, 30, "w1", encode_scorers([])) for r in results]
    )
    assert none is None and outcome == "parked" and decision.outcome == "decided_now"
    again = await ledger.decide(g, "complete", worker_id="w2", scorers=b"\x90", group_timeout_s=30, republish_grace_s=5)
    assert again.outcome == "already_decided"
    assert decision.members == again.members  # decoded from Redis by the second reader
    assert msgspec.msgpack.encode(assemble_verdict(g, decision.state, decision.members)) == msgspec.msgpack.encode(
        assemble_verdict(g, again.state, again.members)
    )


async def _calls(led: GroupLedger, work) -> dict[str, int]:
    """Commands Redis ran for ``work`` (scripts' own commands included), by INFO commandstats."""
    before = await led.view.command_calls()
    await work()
    after = await led.view.command_calls()
    return {c: n - before.get(c, 0) for c, n in after.items() if n - before.get(c, 0) and c != "info"}


async def test_a_group_costs_one_hash_and_few_commands(redis_url: str) -> None:
    """The commands of one group of 4 whose members park one at a time (each park its own
    call: the worst case), counted by the server: one HMGET + a SISMEMBER per dedupe bucket
    for the probe, one HMGET and one HSET per member, the decision in the last member's
    HSET and one HGETALL, one EXPIRE for the group's hash and one ZADD / ZREM for its
    index entry, the park that opens the group reading only the newest dedupe bucket (its
    probe read the others), and a finish of DEL + SADD (+ the bucket's EXPIRE)."""
    cfg = RedisConfig(url=redis_url, key_prefix=f"cmds-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    try:

        async def one_group() -> None:
            g = f"exp\x1fg-{uuid.uuid4().hex[:6]}"  # an experiment-scoped id: opaque to the ledger
            assert await led.probe_many([(g, f"t{k}") for k in range(4)]) == ["new"] * 4
            for k in range(4):
                outcome, decision = await led.park(_member(f"t{k}"), group_id=g, group_size=4, **ARGS)
            assert outcome == "parked" and decision.outcome == "decided_now" and len(decision.members) == 4
            await led.finish(g)
            assert await led.probe_many([(g, "t0")]) == ["done"]

        await _calls(led, one_group)  # the first group also sets the deadlines index's TTL
        calls = await _calls(led, one_group)
        probes = {"hmget": 2, "sismember": 6}  # plain reads: the probes before (a new group) and after (done)
        assert calls == {
            "evalsha": 5,
            "hmget": 4 + probes["hmget"],
            "sismember": 1 + probes["sismember"],
            "hset": 4,
            "hgetall": 1,
            "expire": 2,
            "zadd": 1,
            "del": 1,
            "sadd": 1,
            "zrem": 1,
        }, calls
        # 25 for the group with its one probe (was 45): 6.25 per trajectory when no two parks share a call
        assert sum(calls.values()) - sum(probes.values()) + 4 == 25
    finally:
        await led.aclose()


@pytest.mark.parametrize("group_size", [4, 8])
async def test_pipeline_shaped_groups_cost_at_most_six_commands_per_trajectory(redis_url: str, group_size: int) -> None:
    """Groups as a worker sees them — members probed in one poll, parked concurrently,
    finished — cost at most 6 Redis commands per trajectory (scripts' own commands included)."""
    cfg = RedisConfig(url=redis_url, key_prefix=f"six-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    try:

        async def one_group(g: str) -> None:
            tids = [f"{g}-{k}" for k in range(group_size)]
            assert await led.probe_many([(g, t) for t in tids]) == ["new"] * group_size
            parked = await asyncio.gather(
                *(led.park(_member(t), group_id=g, group_size=group_size, **ARGS) for t in tids)
            )
            (decision,) = [d for _, d in parked if d is not None]
            assert decision.outcome == "decided_now" and len(decision.members) == group_size
            await led.finish(g)

        async def groups() -> None:
            for i in range(10):
                await one_group(f"g{i}-{uuid.uuid4().hex[:6]}")

        await one_group("warm")
        calls = await _calls(led, groups)
        per_trajectory = sum(calls.values()) / (10 * group_size)
        assert per_trajectory <= 6, (per_trajectory, calls)
    finally:
        await led.aclose()


async def test_a_park_waits_for_its_siblings_and_the_deciding_park_does_not(redis_url: str, monkeypatch) -> None:
    """A park whose group has members this worker probed and has not parked yet waits
    (up to ``PARK_LINGER_S``) for them; the park that decides the group sends at once and
    takes the waiting ones along: one call for both."""
    monkeypatch.setattr(ledger_module, "PARK_LINGER_S", 600.0)  # only company can end the wait
    cfg = RedisConfig(url=redis_url, key_prefix=f"linger-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    try:
        g = f"l-{uuid.uuid4().hex[:6]}"
        assert await led.probe_many([(g, "a"), (g, "b")]) == ["new", "new"]
        before = await led.view.command_calls()
        first = asyncio.create_task(led.park(_member("a"), group_id=g, group_size=2, **ARGS))
        await asyncio.sleep(0)  # submitted: it waits for its sibling
        assert not first.done()
        outcome, decision = await asyncio.wait_for(led.park(_member("b"), group_id=g, group_size=2, **ARGS), 30)
        assert outcome == "parked" and decision is not None and decision.outcome == "decided_now"
        assert await asyncio.wait_for(first, 30) == ("parked", None)
        assert (await led.view.command_calls())["evalsha"] - before["evalsha"] == 1
        # a failed member decides at once too, waiting siblings or not
        f = f"f-{uuid.uuid4().hex[:6]}"
        await led.probe_many([(f, "a"), (f, "b"), (f, "c")])
        failed = SessionResult.failure(code="scorer_error", detail="boom", session_id="s-a", trajectory_id="a")
        outcome, decision = await asyncio.wait_for(led.park(failed, group_id=f, group_size=3, **ARGS), 30)
        assert decision is not None and decision.state.decision == "failed"
    finally:
        await led.aclose()


async def test_a_group_finished_between_probe_and_park_is_not_reopened(redis_url: str) -> None:
    """The park that would open a group reads only the dedupe buckets written since its
    worker's probe; a finish by another worker in between is among them."""
    cfg = RedisConfig(url=redis_url, key_prefix=f"race-{uuid.uuid4().hex[:6]}", ttl_s=60)
    mine, other = GroupLedger.from_config(cfg), GroupLedger.from_config(cfg)
    try:
        g = f"p-{uuid.uuid4().hex[:6]}"
        assert await mine.probe_many([(g, "a")]) == ["new"]
        _, decision = await other.park(_member("a"), group_id=g, group_size=1, **ARGS)
        assert decision is not None and decision.outcome == "decided_now"
        await other.finish(g)
        assert await mine.park(_member("a"), group_id=g, group_size=1, **ARGS) == ("done", None)
        assert not await mine.redis.exists(mine.group_key(g))
    finally:
        await mine.aclose()
        await other.aclose()


async def test_discard_before_any_member(ledger) -> None:
    g = f"d-{uuid.uuid4().hex[:6]}"
    decision = await ledger.decide(
        g, "discard", worker_id="w1", scorers=b"\x90", discard_reason="no", group_timeout_s=30, republish_grace_s=5
    )
    assert decision.outcome == "decided_now"
    assert assemble_verdict(g, decision.state, decision.members).status == "discarded"
    outcome, _ = await ledger.park(_member("late"), group_id=g, group_size=2, **ARGS)
    assert outcome == "decided"  # not parked, not scored again


async def test_a_failed_member_decides_its_group_when_parked(ledger) -> None:
    g = f"x-{uuid.uuid4().hex[:6]}"
    assert await ledger.park(_member("a"), group_id=g, group_size=3, **ARGS) == ("parked", None)
    # a redelivered copy of a member parked as scored that fails this time: the first park stands
    redelivered = SessionResult.failure(code="scorer_error", detail="flaky", session_id="s-a", trajectory_id="a")
    assert await ledger.park(redelivered, group_id=g, group_size=3, **ARGS) == ("duplicate", None)
    failed = SessionResult.failure(
        code="not_concat_export", detail="turn 2 does not extend turn 1", session_id="s-b", trajectory_id="b"
    )
    outcome, decision = await ledger.park(failed, group_id=g, group_size=3, **ARGS)
    assert outcome == "parked" and decision is not None and decision.outcome == "decided_now"
    assert decision.state.decision == "failed" and decision.state.group_size == 3
    verdict = assemble_verdict(g, decision.state, decision.members)
    assert (verdict.status, verdict.reason_code) == ("rejected", "not_concat_export")
    assert verdict.reason == "not_concat_export: member 'b' (session 's-b'): turn 2 does not extend turn 1"
    assert {s.trajectory_id: s.status for s in verdict.sessions} == {"a": "scored", "b": "failed"}
    # the third member comes too late: the group is decided, nothing is parked
    assert await ledger.park(_member("c"), group_id=g, group_size=3, **ARGS) == ("decided", None)


async def test_deadline_is_decided_by_exactly_one_caller(ledger) -> None:
    g = f"m-{uuid.uuid4().hex[:6]}"
    await ledger.park(_member("a"), group_id=g, group_size=3, **{**ARGS, "group_timeout_s": 0})
    results = await asyncio.gather(
        *(
            ledger.decide(g, "deadline", worker_id=f"w{i}", scorers=b"\x90", group_timeout_s=0, republish_grace_s=5)
            for i in range(8)
        )
    )
    assert sorted(r.outcome for r in results).count("decided_now") == 1
    verdict = assemble_verdict(g, results[0].state, results[0].members)
    assert verdict.status == "rejected" and verdict.reason_code == "missing_sessions"
    assert verdict.reason.startswith("missing_sessions: 1 of 3")


async def test_members_disagreeing_on_group_size_reject_the_group(ledger) -> None:
    g = f"z-{uuid.uuid4().hex[:6]}"
    await ledger.park(_member("a"), group_id=g, group_size=3, **ARGS)
    outcome, decision = await ledger.park(_member("b"), group_id=g, group_size=2, **ARGS)
    assert decision is not None and decision.outcome == "decided_now"
    assert assemble_verdict(g, decision.state, decision.members).reason_code == "group_size_mismatch"


async def test_scripts_are_reloaded_after_a_script_flush(ledger) -> None:
    g = f"f-{uuid.uuid4().hex[:6]}"
    await ledger.probe_many([(g, "x")])
    await ledger.redis.script_flush()  # what a Redis restart does to the script cache
    assert await ledger.probe_many([(g, "x")]) == ["new"]


async def test_finished_groups_are_remembered_for_the_dedupe_window_only(redis_url: str) -> None:
    window_s = 2.0
    cfg = RedisConfig(url=redis_url, key_prefix=f"window-{uuid.uuid4().hex[:6]}", ttl_s=60)
    ledger = GroupLedger.from_config(cfg, dedupe_window_s=window_s)
    try:
        g = f"w-{uuid.uuid4().hex[:6]}"
        _, decision = await ledger.park(_member("a"), group_id=g, group_size=1, **ARGS)
        assert decision is not None and decision.outcome == "decided_now"
        await ledger.finish(g)
        finished = time.monotonic()
        assert await ledger.probe_many([(g, "a"), (g, "late")]) == ["done", "done"]
        outcome, _ = await ledger.park(_member("late"), group_id=g, group_size=1, **ARGS)
        assert outcome == "done"  # a late member does not re-open the group
        assert not await ledger.redis.exists(ledger.group_key(g))  # the group's own hash is gone
        await eventually(
            lambda: ledger.probe_many([(g, "a")]),
            accept=lambda got: got != ["done"],
            interval_s=0.1,
            timeout_s=finished + 4 * window_s + 2 - time.monotonic(),
            what="the finished group to be forgotten",
        )
        assert time.monotonic() - finished >= window_s  # remembered for the whole window
    finally:
        await ledger.aclose()


async def test_expected_members_wait_for_each_other_without_a_probe(redis_url: str, monkeypatch) -> None:
    """Records scored without a probe (no one else can have read them) are announced with
    ``expect``: a park still waits for its groupmates, so both share one call, and no
    probe read reaches Redis."""
    monkeypatch.setattr(ledger_module, "PARK_LINGER_S", 600.0)  # only company can end the wait
    cfg = RedisConfig(url=redis_url, key_prefix=f"expect-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    try:
        g = f"e-{uuid.uuid4().hex[:6]}"
        await led.redis.ping()
        before = await led.view.command_calls()
        led.expect([(g, "a"), (g, "b")])
        first = asyncio.create_task(led.park(_member("a"), group_id=g, group_size=2, **ARGS))
        await asyncio.sleep(0)
        assert not first.done()
        _, decision = await asyncio.wait_for(led.park(_member("b"), group_id=g, group_size=2, **ARGS), 30)
        assert decision is not None and decision.outcome == "decided_now"
        assert await asyncio.wait_for(first, 30) == ("parked", None)
        after = await led.view.command_calls()
        assert after["evalsha"] - before.get("evalsha", 0) == 1
        assert after.get("hmget", 0) - before.get("hmget", 0) == 2  # the two parks' own reads, no probe's
    finally:
        await led.aclose()


async def _finished(cfg: RedisConfig, g: str) -> bool:
    """Seen by another instance: the group's hash is gone and its fingerprint is in a dedupe bucket."""
    other = GroupLedger.from_config(cfg)
    try:
        return not await other.redis.exists(other.group_key(g)) and await other.probe_many([(g, "x")]) == ["done"]
    finally:
        await other.aclose()


async def test_a_lazy_finish_rides_along_with_the_next_call(redis_url: str, monkeypatch) -> None:
    monkeypatch.setattr(ledger_module, "FINISH_LINGER_S", 600.0)  # only company can end the wait
    cfg = RedisConfig(url=redis_url, key_prefix=f"lazy-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    try:
        g, h = f"g-{uuid.uuid4().hex[:6]}", f"h-{uuid.uuid4().hex[:6]}"
        _, decision = await led.park(_member("a"), group_id=g, group_size=1, **ARGS)
        assert decision is not None and decision.outcome == "decided_now"
        before = await led.view.command_calls()
        led.finish_soon(g)  # returns at once: the caller releases its record
        await eventually(lambda: led.lingering, timeout_s=10, interval_s=0.001, what="the finish to linger")
        assert led.pending_finishes == 1 and await led.redis.exists(led.group_key(g))
        assert await led.park(_member("a"), group_id=h, group_size=2, **ARGS) == ("parked", None)
        await eventually(lambda: not led.pending_finishes, timeout_s=30, interval_s=0.01, what="the finish to land")
        assert (await led.view.command_calls())["evalsha"] - before.get("evalsha", 0) == 1  # the park's call carried it
        assert await _finished(cfg, g)
    finally:
        await led.aclose()


async def test_close_flushes_pending_finishes(redis_url: str, monkeypatch) -> None:
    monkeypatch.setattr(ledger_module, "FINISH_LINGER_S", 600.0)
    cfg = RedisConfig(url=redis_url, key_prefix=f"flush-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    g = f"g-{uuid.uuid4().hex[:6]}"
    _, decision = await led.park(_member("a"), group_id=g, group_size=1, **ARGS)
    assert decision is not None
    led.finish_soon(g)
    await asyncio.wait_for(led.aclose(), 30)  # long before the linger would have ended
    assert await _finished(cfg, g)


async def test_a_finish_that_fails_transiently_is_retried_and_counted(redis_url: str, monkeypatch) -> None:
    """Redis pauses writes longer than the client's timeout: the finish fails, is told to
    ``on_finish_error``, and lands once Redis takes writes again."""
    import redis.asyncio as aioredis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    monkeypatch.setattr(ledger_module, "FINISH_LINGER_S", 0.0)
    cfg = RedisConfig(url=redis_url, key_prefix=f"retry-{uuid.uuid4().hex[:6]}", ttl_s=60)
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    led = GroupLedger(client, cfg)
    admin = aioredis.Redis.from_url(redis_url)
    errors: list[BaseException] = []
    led.on_finish_error = errors.append
    try:
        g = f"g-{uuid.uuid4().hex[:6]}"
        _, decision = await led.park(_member("a"), group_id=g, group_size=1, **ARGS)
        assert decision is not None
        await admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        led.finish_soon(g)
        await eventually(lambda: not led.pending_finishes, timeout_s=30, interval_s=0.02, what="the finish to land")
        assert errors and all(isinstance(e, REDIS_OUTAGES) for e in errors)
        assert await _finished(cfg, g)
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
        await led.aclose()


async def test_a_park_does_not_wait_for_a_pending_finish_longer_than_its_own_linger(
    redis_url: str, monkeypatch
) -> None:
    """A finish lingering far longer than a park does not hold the park back: the park
    goes after its own ``PARK_LINGER_S`` and takes the finish along."""
    monkeypatch.setattr(ledger_module, "FINISH_LINGER_S", 600.0)
    cfg = RedisConfig(url=redis_url, key_prefix=f"rearm-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    try:
        g, h = f"g-{uuid.uuid4().hex[:6]}", f"h-{uuid.uuid4().hex[:6]}"
        _, decision = await led.park(_member("a"), group_id=g, group_size=1, **ARGS)
        assert decision is not None
        led.finish_soon(g)
        await eventually(lambda: led.lingering, timeout_s=10, interval_s=0.001, what="the finish to linger")
        led.expect([(h, "a"), (h, "b")])  # b never comes: a's park waits PARK_LINGER_S, not the finish's 600 s
        assert await asyncio.wait_for(led.park(_member("a"), group_id=h, group_size=2, **ARGS), 5) == ("parked", None)
        await eventually(
            lambda: not led.pending_finishes, timeout_s=5, interval_s=0.01, what="the finish to go with the park"
        )
        assert await _finished(cfg, g)
    finally:
        await led.aclose()


async def test_a_park_waits_for_members_not_yet_seen_and_a_sweep_rides_along(redis_url: str, monkeypatch) -> None:
    """A group split over two fetches: its first member's park, with no groupmate announced,
    waits (``PARK_UNSEEN_LINGER_S``) for the members this worker has not seen yet; the
    park that completes the group sends at once, and a sweeper's index read waiting for
    company goes in the same round trip."""
    monkeypatch.setattr(ledger_module, "PARK_UNSEEN_LINGER_S", 600.0)  # only company can end the wait
    cfg = RedisConfig(url=redis_url, key_prefix=f"unseen-{uuid.uuid4().hex[:6]}", ttl_s=60)
    led = GroupLedger.from_config(cfg)
    try:
        g = f"u-{uuid.uuid4().hex[:6]}"
        await led.redis.ping()
        before = await led.view.command_calls()
        first = asyncio.create_task(led.park(_member("a"), group_id=g, group_size=2, **ARGS))
        sweep = asyncio.create_task(led.due_groups(linger_s=600.0))
        await eventually(
            lambda: led.lingering and len(led._ops._pending) == 2,
            timeout_s=10,
            interval_s=0.001,
            what="both to wait for company",
        )
        assert not first.done() and not sweep.done()
        _, decision = await asyncio.wait_for(led.park(_member("b"), group_id=g, group_size=2, **ARGS), 30)
        assert decision is not None and decision.outcome == "decided_now"
        assert await asyncio.wait_for(first, 30) == ("parked", None)
        assert await asyncio.wait_for(sweep, 30) == []
        after = await led.view.command_calls()
        assert after["evalsha"] - before.get("evalsha", 0) == 1
        assert after["zrangebyscore"] - before.get("zrangebyscore", 0) == 1
        # a group of one, or a failed member, never waits
        _, decision = await asyncio.wait_for(led.park(_member("c"), group_id=f"{g}-1", group_size=1, **ARGS), 30)
        assert decision is not None and decision.outcome == "decided_now"
    finally:
        await led.aclose()
