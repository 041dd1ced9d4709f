"""The gateway's connections, over real sockets against the real gateway on the embedded stack:
idle keep-alive connections close after ``gateway.keepalive_timeout_s``, and one client address
holds at most ``gateway.max_connections_per_client`` connections (one more is answered 429 and
closed)."""

from __future__ import annotations

import asyncio

import pytest

from infra.config import GatewayConfig, PRMScorerConfig
from tests.integration.harness import isolated_config
from tests.integration.test_gateway import gateway
from tests.polling import poll_until

pytestmark = pytest.mark.integration

BUDGET = PRMScorerConfig("scoring_workers.scorers.LengthBudgetScorer", kwargs={"max_output_tokens": 1000})
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"


@pytest.fixture
def cfg(kafka_bootstrap: str, redis_url: str, unique_name: str):
    return isolated_config(unique_name, kafka_bootstrap, redis_url, scorers=[BUDGET])


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response's status and body (``Content-Length`` framed)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    length = next(int(v) for k, _, v in (line.partition(":") for line in lines) if k.lower() == "content-length")
    return int(status_line.split(" ")[1]), await asyncio.wait_for(reader.readexactly(length), 10)


async def _closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Whether the gateway closes the connection within ``timeout_s`` (EOF, or a reset)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout_s) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_the_defaults_are_bounded() -> None:
    gw = GatewayConfig()
    assert 0 < gw.keepalive_timeout_s <= 60 and 0 < gw.max_connections_per_client <= 1024


async def test_idle_keep_alive_connections_are_closed_after_the_timeout(cfg) -> None:
    async with gateway(cfg, keepalive_timeout_s=1.0) as url:
        silent = [await _connect(url) for _ in range(50)]  # never send a byte
        reader, writer = used = await _connect(url)  # one request, then idle on a kept-alive connection
        writer.write(HEALTHZ)
        assert (await _answer(reader))[0] == 200
        closed = await asyncio.gather(*(_closed_within(r, 10) for r, _ in [*silent, used]))
        for _, w in [*silent, used]:
            w.close()
    assert all(closed), f"{closed.count(False)} of {len(closed)} idle connections still open after 10 s"


async def test_connections_per_client_address_are_capped(cfg) -> None:
    async with gateway(cfg, max_connections_per_client=3) as url:
        held = [await _connect(url) for _ in range(3)]
        reader, writer = await _connect(url)  # the fourth from 127.0.0.1
        status, body = await _answer(reader)
        assert status == 429 and b"max_connections_per_client" in body, body
        assert await _closed_within(reader, 10)
        writer.close()
        for r, w in held:  # the three admitted ones serve requests
            w.write(HEALTHZ)
            assert (await _answer(r))[0] == 200
        held.pop()[1].close()  # one goes: its place is free again

        refusals = [status]

        async def healthz_on_a_new_connection() -> int:
            r, w = await _connect(url)
            try:
                w.write(HEALTHZ)
                answered = (await _answer(r))[0]
            finally:
                w.close()
            if answered == 429:  # the gateway has not seen the close yet
                refusals.append(answered)
            return answered

        admitted = (
            await poll_until(healthz_on_a_new_connection, accept=lambda status: status == 200, timeout_s=10)
        ).held
        assert admitted
        r, w = held[0]
        w.write(b"GET /metrics HTTP/1.1\r\nHost: gateway\r\n\r\n")
        status, metrics = await _answer(r)
        for _, w in held:
            w.close()
    assert status == 200 and f"prm_gateway_connections_refused_total {len(refusals)}.0".encode() in metrics, metrics
