"""Judge HTTP hygiene against the real fake judge server (no mocking of the HTTP client).

Timing assertions are limited to "no request waits longer than its timeout" (upper
bounds with a generous margin); everything else is asserted on counters.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from typing import Any

import pytest

from infra.errors import ConfigError
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from scoring_workers.judge.apis import openai_chat, sglang_generate_text, sglang_input_logprobs
from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.errors import CircuitOpenError, JudgeRequestError, JudgeTimeoutError
from scoring_workers.judge.limits import CircuitBreaker, _Pacer, registered_limits
from scoring_workers.judge.settings import (
    ClientSettings,
    ConnectionSettings,
    LimitSettings,
    ModelSettings,
    RequestSettings,
)
from tests.polling import eventually

MARGIN_S = 0.5  # scheduling slack on a loaded CI machine; still far below the server latency
PRM_PROMPT = [{"role": "user", "content": "## Next state [role: user]\nthanks, ok!"}]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def server():
    srv = FakeJudgeServer()
    srv.start()
    yield srv
    srv.stop()


def _client(url: str, *, clock: Any = time.monotonic, **flat: Any) -> JudgeClient:
    flat.setdefault("backoff_base_s", 0.001)
    flat.setdefault("backoff_max_s", 0.01)
    return JudgeClient(url, ClientSettings.from_flat(flat), rng=random.Random(0), clock=clock)


MODEL = ModelSettings(model="judge", temperature=0.6, max_tokens=64)


async def _chat(client: JudgeClient, **kwargs) -> str:
    return await openai_chat(client, PRM_PROMPT, MODEL, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- retries
async def test_5xx_is_retried_then_succeeds(server):
    server.fail_next(503, 2)
    async with _client(server.base_url, max_retries=2) as client:
        assert "\\boxed{1}" in await _chat(client)
        assert client.stats.attempts == 3 and client.stats.retries == 2 and client.stats.succeeded == 1
    assert server.requests == 3 and server.statuses[503] == 2 and server.statuses[200] == 1


async def test_429_is_retried_honouring_retry_after(server):
    server.fail_next(429, 1, retry_after=0.05)
    async with _client(server.base_url, max_retries=1, backoff_max_s=0.2) as client:  # backoff_base_s = 1 ms
        started = time.monotonic()
        assert "\\boxed{1}" in await _chat(client)
        assert time.monotonic() - started >= 0.05  # Retry-After is a floor under the backoff
    assert server.statuses[429] == 1 and server.requests == 2


def test_backoff_base_past_its_cap_is_refused() -> None:
    with pytest.raises(ConfigError, match="backoff_base_s"):
        ClientSettings.from_flat({"backoff_base_s": 2.0, "backoff_max_s": 1.0})


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_4xx_is_not_retried(server, status):
    server.fail_next(status, 5)
    async with _client(server.base_url, max_retries=3) as client:
        with pytest.raises(JudgeRequestError) as info:
            await _chat(client)
    assert info.value.status == status and info.value.kind == "http_status" and info.value.attempts == 1
    assert server.requests == 1


async def test_5xx_retries_are_bounded(server):
    server.fail_next(500, 10)
    async with _client(server.base_url, max_retries=2) as client:
        with pytest.raises(JudgeRequestError) as info:
            await _chat(client)
    assert info.value.status == 500 and info.value.attempts == 3 and server.requests == 3


async def test_connect_errors_are_retried():
    url = f"http://127.0.0.1:{_free_port()}"
    async with _client(url, max_retries=2, timeout_s=2, total_timeout_s=5) as client:
        with pytest.raises(JudgeRequestError) as info:
            await _chat(client)
        assert info.value.kind == "connect" and info.value.attempts == 3
        assert client.stats.attempts == 3 and client.stats.retries == 2


async def test_reset_connection_is_a_transport_error_not_retried():
    with FakeJudgeServer(outage_mode="reset") as srv:
        srv.set_outage(True)
        async with _client(srv.base_url, max_retries=3) as client:
            with pytest.raises(JudgeRequestError) as info:
                await _chat(client)
        assert info.value.kind == "transport" and info.value.attempts == 1


# --------------------------------------------------------------------------- timeouts
async def test_a_request_never_waits_longer_than_its_timeout():
    with FakeJudgeServer(latency_ms=5000) as srv:
        async with _client(srv.base_url, timeout_s=0.2, total_timeout_s=10, max_retries=3) as client:
            async with asyncio.timeout(5):  # the test itself never hangs
                start = time.monotonic()
                with pytest.raises(JudgeTimeoutError) as info:
                    await _chat(client)
                elapsed = time.monotonic() - start
        assert elapsed < 0.2 + MARGIN_S
        assert info.value.kind == "timeout" and info.value.attempts == 1  # timeouts are not retried


async def test_total_timeout_bounds_retries_and_backoff():
    # Every attempt is answered 503 after 150 ms; retries and backoff must stop at the total budget.
    with FakeJudgeServer(latency_ms=150) as srv:
        srv.fail_next(503, 100, retry_after=0.1)
        async with _client(
            srv.base_url, timeout_s=5, total_timeout_s=0.5, max_retries=50, backoff_base_s=0.05, backoff_max_s=0.2
        ) as client:
            async with asyncio.timeout(5):
                start = time.monotonic()
                with pytest.raises(JudgeRequestError):
                    await _chat(client)
                elapsed = time.monotonic() - start
        assert elapsed < 0.5 + MARGIN_S
        assert 1 <= client.stats.attempts < 50


async def test_caller_deadline_bounds_the_request():
    with FakeJudgeServer(latency_ms=5000) as srv:
        async with _client(srv.base_url, timeout_s=30, total_timeout_s=30) as client:
            loop = asyncio.get_running_loop()
            start = time.monotonic()
            with pytest.raises(JudgeTimeoutError):
                await _chat(client, deadline=loop.time() + 0.2)
            assert time.monotonic() - start < 0.2 + MARGIN_S


async def test_waiting_for_a_shared_slot_respects_the_total_timeout():
    with FakeJudgeServer(latency_ms=3000) as srv:
        holder = _client(srv.base_url, max_concurrency=1, timeout_s=10, total_timeout_s=10)
        waiter = _client(srv.base_url, timeout_s=10, total_timeout_s=0.3)  # inherits the shared cap of 1
        try:
            slow = asyncio.ensure_future(_chat(holder))
            await eventually(
                lambda: holder.limits.in_flight, timeout_s=5, interval_s=0.005, what="the holder's call in flight"
            )
            start = time.monotonic()
            with pytest.raises(JudgeTimeoutError, match="no free judge slot"):
                await _chat(waiter)
            assert time.monotonic() - start < 0.3 + MARGIN_S
            assert waiter.stats.attempts == 0  # never reached the wire
            slow.cancel()
            await asyncio.gather(slow, return_exceptions=True)
        finally:
            await holder.aclose()
            await waiter.aclose()


# --------------------------------------------------------------------------- limits
async def test_concurrency_cap_is_shared_by_all_clients_of_a_base_url():
    with FakeJudgeServer(latency_ms=40) as srv:
        a = _client(srv.base_url, max_concurrency=3)
        b = _client(srv.base_url)  # inherits
        try:
            assert a.limits is b.limits and b.limits.settings.max_concurrency == 3
            outs = await asyncio.gather(*[_chat(c) for c in (a, b) for _ in range(12)])
            assert all("\\boxed{1}" in o for o in outs)
            assert srv.requests == 24
            assert srv.max_in_flight <= 3 and a.limits.max_in_flight <= 3
        finally:
            await a.aclose()
            await b.aclose()


async def test_registry_conflicts_and_release(server):
    url = server.base_url
    a = _client(url, max_concurrency=2, rps=0)
    try:
        with pytest.raises(ValueError, match="max_concurrency=3"):
            _client(url, max_concurrency=3)
        b = _client(url + "/", breaker_failure_threshold=5)  # same key, default threshold: no conflict
        assert b.limits is a.limits and registered_limits(url).refs == 2
        await b.aclose()
        await b.aclose()  # idempotent
        assert registered_limits(url).refs == 1
    finally:
        await a.aclose()
    assert registered_limits(url) is None
    with pytest.raises(RuntimeError, match="closed"):
        await _chat(a)


async def test_pacer_spaces_slots_and_refuses_late_ones():
    loop = asyncio.get_running_loop()
    pacer = _Pacer(rps=1000.0)
    t0 = loop.time()
    assert all(await asyncio.gather(*[pacer.wait(loop, loop.time() + 10) for _ in range(5)]))
    assert pacer.next_at >= t0 + 5 * 0.001 - 1e-9  # five slots reserved 1 ms apart
    before = pacer.next_at
    assert not await pacer.wait(loop, loop.time() - 1)  # a slot past the deadline is not reserved
    assert pacer.next_at == before


async def test_rps_limit_is_applied(server):
    async with _client(server.base_url, rps=200.0) as client:
        outs = await asyncio.gather(*[_chat(client) for _ in range(5)])
        assert len(outs) == 5
        pacer = client.limits.gate(asyncio.get_running_loop()).pacer
        assert pacer is not None and pacer.interval == pytest.approx(0.005)


# --------------------------------------------------------------------------- breaker
def test_circuit_breaker_state_machine_with_fake_clock():
    clock = FakeClock()
    cb = CircuitBreaker(failure_threshold=3, reset_timeout_s=10, clock=clock)
    assert cb.state == "closed"
    for _ in range(2):
        cb.record(cb.acquire(), False)
    cb.record(cb.acquire(), True)  # a success resets the consecutive count
    assert cb.state == "closed" and cb.consecutive_failures == 0
    tickets = [cb.acquire() for _ in range(3)]
    for t in tickets:
        cb.record(t, False)
    assert cb.state == "open" and cb.opened_count == 1
    assert cb.acquire() is None and cb.rejected_count == 1  # fail fast
    clock.advance(9.9)
    assert cb.acquire() is None and cb.state == "open"
    clock.advance(0.2)
    assert cb.state == "half_open"
    probe = cb.acquire()
    assert probe is not None and probe.probe
    assert cb.acquire() is None  # only one probe at a time
    cb.record(probe, False)  # probe failed -> open again
    assert cb.state == "open" and cb.opened_count == 2
    clock.advance(10)
    probe = cb.acquire()
    cb.record(probe, None)  # cancelled probe: no verdict, slot released
    assert cb.state == "half_open"
    probe = cb.acquire()
    assert probe is not None
    cb.record(probe, True)
    assert cb.state == "closed" and cb.consecutive_failures == 0
    cb.record(probe, False)  # recording twice is ignored
    assert cb.state == "closed" and cb.consecutive_failures == 0


def test_stale_verdicts_do_not_move_the_breaker():
    clock = FakeClock()
    cb = CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=clock)
    early = cb.acquire()  # admitted while closed
    cb.record(cb.acquire(), False)
    assert cb.state == "open"
    cb.record(early, True)  # a late success from before the opening does not close it
    assert cb.state == "open"
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(reset_timeout_s=0)


async def test_breaker_fails_fast_while_the_judge_is_down_and_recovers(server):
    clock = FakeClock()
    async with _client(
        server.base_url, max_retries=0, breaker_failure_threshold=2, breaker_reset_s=30, clock=clock
    ) as client:
        server.set_outage(True)
        for _ in range(2):
            with pytest.raises(JudgeRequestError) as info:
                await _chat(client)
            assert info.value.status == 503
        assert client.breaker.state == "open"
        seen = server.requests
        for _ in range(5):
            with pytest.raises(CircuitOpenError):
                await _chat(client)
        assert server.requests == seen  # nothing reached the dead judge
        assert client.stats.circuit_rejections == 5
        server.set_outage(False)
        clock.advance(31)
        assert client.breaker.state == "half_open"
        assert "\\boxed{1}" in await _chat(client)  # the probe succeeds
        assert client.breaker.state == "closed"


async def test_a_4xx_counts_as_the_server_being_up(server):
    clock = FakeClock()
    async with _client(
        server.base_url, max_retries=0, breaker_failure_threshold=1, breaker_reset_s=5, clock=clock
    ) as client:
        server.fail_next(500)
        with pytest.raises(JudgeRequestError):
            await _chat(client)
        assert client.breaker.state == "open"
        clock.advance(6)
        server.fail_next(400)
        with pytest.raises(JudgeRequestError):
            await _chat(client)
        assert client.breaker.state == "closed"


# --------------------------------------------------------------------------- fake server
async def test_fake_server_outage_windows_and_error_rate():
    with FakeJudgeServer(outages=[(0.0, 3600.0)]) as srv:
        async with _client(srv.base_url, max_retries=0) as client:
            with pytest.raises(JudgeRequestError) as info:
                await _chat(client)
            assert info.value.status == 503
    with FakeJudgeServer(error_rate=1.0) as srv:
        async with _client(srv.base_url, max_retries=1) as client:
            with pytest.raises(JudgeRequestError) as info:
                await _chat(client)
            assert info.value.status == 500 and srv.requests == 2


async def test_sglang_endpoints(server):
    async with _client(server.base_url + "/v1") as client:  # a trailing /v1 is stripped
        assert client.base_url == server.base_url
        text = await sglang_generate_text(
            client, "## Next state [role: tool]\nError: no such file", ModelSettings(temperature=0.6, max_tokens=32)
        )
        assert text.endswith("\\boxed{-1}")
        rows = await sglang_input_logprobs(client, [65, 66, 67, 68], logprob_start_len=0)
        assert len(rows) == 4 and rows[0] is None and all(isinstance(v, float) for v in rows[1:])
        assert len(await sglang_input_logprobs(client, [65, 66, 67, 68], logprob_start_len=2)) == 2
        with pytest.raises(JudgeRequestError) as info:
            await client.post_json("/nope", {})
        assert info.value.status == 404
    assert server.by_path["/generate"] == 3


def test_client_validates_arguments():
    with pytest.raises(ValueError):
        JudgeClient("judge:3000")
    with pytest.raises(TypeError, match="ClientSettings"):
        JudgeClient("http://x", {"timeout_s": 1})  # type: ignore[arg-type]
    assert registered_limits("http://x") is None  # failed constructors register nothing


@pytest.mark.parametrize(
    ("flat", "needle"),
    [
        ({"timeout_s": 0}, "timeout_s: Expected `float` > 0.0 (a duration in seconds, above zero)"),
        ({"total_timeout_s": float("inf")}, "total_timeout_s: Expected `float` <= 1000000000.0"),
        ({"max_retries": -1}, "max_retries: Expected `int` >= 0"),
        ({"max_retries": True}, "max_retries: Expected `int`, got `bool`"),
        ({"max_concurrency": 0}, "max_concurrency: Expected `int` >= 1"),
        ({"rps": float("nan")}, "rps: Expected `float` >= 0.0"),
        ({"headers": {"X-A": None}}, None),  # None becomes the text "None": headers are text
        ({"spill_ratio": 0.5}, "spill_ratio: Expected `float` >= 1.0"),
        ({"timeout": 5}, "no judge client setting timeout"),  # a typo is not ignored
    ],
)
def test_settings_are_typed_and_bounded(flat, needle):
    if needle is None:
        assert ClientSettings.from_flat(flat, "judge").connection.headers == {"X-A": "None"}
        return
    with pytest.raises(ValueError) as info:
        ClientSettings.from_flat(flat, "judge")
    assert str(info.value) == f"judge: {needle}" or needle in str(info.value), str(info.value)


def test_settings_built_in_code_are_checked_too():
    with pytest.raises(ValueError, match="RequestSettings.timeout_s: Expected `float` > 0.0"):
        RequestSettings(timeout_s=0)
    with pytest.raises(ValueError, match="ClientSettings.limits.max_concurrency: Expected `int` >= 1"):
        ClientSettings(limits=_unchecked(LimitSettings, max_concurrency=0))  # the whole is checked again
    with pytest.raises(ValueError, match="top_k must be -1"):
        ModelSettings(top_k=0)
    settings = ClientSettings(request=RequestSettings(timeout_s=2), connection=ConnectionSettings(api_key="s3cr3t"))
    assert settings.request.timeout_s == 2 and "s3cr3t" not in repr(settings)  # a key is never printed
    with pytest.raises(AttributeError):
        settings.request.timeout_s = 5  # type: ignore[misc]  # frozen


def _unchecked(cls, **values):
    """A struct that skipped its checks (msgspec.convert with the checks switched off)."""
    from scoring_workers.judge import settings as module

    token = module._CONVERTING.set(True)
    try:
        return cls(**values)
    finally:
        module._CONVERTING.reset(token)


# --------------------------------------------------------------------------- CLI
def test_fake_judge_parser():
    import argparse

    from prm_pipeline.demo.fake_judge import add_fake_judge_parser, cmd_fake_judge

    parser = argparse.ArgumentParser()
    add_fake_judge_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "fake-judge",
            "--port",
            "0",
            "--latency",
            "0.005",
            "--error-rate",
            "0.1",
            "--outage",
            "1:2",
            "--outage",
            "3:4.5",
        ]
    )
    assert args.func is cmd_fake_judge and args.outage == [(1.0, 2.0), (3.0, 4.5)]
    assert (args.port, args.latency, args.error_rate, args.outage_mode) == (0, 0.005, 0.1, "503")
    for bad in (["--outage", "5:1"], ["--outage", "x"], ["--error-rate", "2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["fake-judge", "--port", "0", *bad])


async def test_fake_judge_cli_serves_and_exits_cleanly_on_sigterm():
    import signal
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prm_pipeline.demo.fake_judge", "--port", "0", stdout=asyncio.subprocess.PIPE
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("PRM_JUDGE_URL=http://127.0.0.1:")
        async with _client(line.strip().split("=", 1)[1]) as client:
            assert "\\boxed{1}" in await _chat(client)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_base_url_path_prefix_is_kept(server):
    # A judge behind a path prefix (e.g. a gateway route): paths are appended, not substituted.
    async with _client(server.base_url + "/gateway") as client:
        with pytest.raises(JudgeRequestError) as info:
            await _chat(client)
    assert info.value.status == 404 and "/gateway/v1/chat/completions" in str(info.value)


async def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "judge-key"
    key_file.write_text("file-secret\n")
    url = "http://127.0.0.1:9/api-key-test"
    from_file = JudgeClient(url, ClientSettings(connection=ConnectionSettings(api_key_file=str(key_file))))
    monkeypatch.setenv("PRM_TEST_JUDGE_KEY", "env-secret")
    env_and_file = ConnectionSettings(api_key_env="PRM_TEST_JUDGE_KEY", api_key_file=str(key_file))
    both = JudgeClient(url, ClientSettings(connection=env_and_file))
    try:
        assert from_file._headers["Authorization"] == "Bearer file-secret"  # whitespace stripped
        assert both._headers["Authorization"] == "Bearer env-secret"  # the environment variable wins
        with pytest.raises(ValueError, match="api_key_file .*missing.* cannot be read"):
            JudgeClient(url, ClientSettings(connection=ConnectionSettings(api_key_file=str(tmp_path / "missing"))))
    finally:
        await from_file.aclose()
        await both.aclose()
    assert registered_limits(url) is None


async def test_an_open_circuit_names_the_error_that_opened_it():
    """A judge outage reports its cause, not only ``circuit_open``: the refused request's
    message carries the last underlying error (here: nothing listens on the port)."""
    url = f"http://127.0.0.1:{_free_port()}"
    async with _client(
        url, max_retries=0, breaker_failure_threshold=1, breaker_reset_s=30, clock=FakeClock()
    ) as client:
        with pytest.raises(JudgeRequestError) as first:
            await _chat(client)
        assert first.value.kind == "connect"
        with pytest.raises(CircuitOpenError) as refused:
            await _chat(client)
    message = str(refused.value)
    assert "circuit breaker open after 1 consecutive failed attempts" in message
    assert f"last error: POST {url}: cannot connect" in message, message  # scheme://host:port, nothing more
    assert client.breaker.last_error is not None and "cannot connect" in client.breaker.last_error


async def test_an_http_failure_is_the_breakers_last_error(server):
    async with _client(
        server.base_url, max_retries=0, breaker_failure_threshold=1, breaker_reset_s=30, clock=FakeClock()
    ) as client:
        server.set_outage(True)
        with pytest.raises(JudgeRequestError):
            await _chat(client)
        with pytest.raises(CircuitOpenError, match="last error: POST .*: HTTP 503"):
            await _chat(client)
