"""The judge's HTTP/1.1 transport against scripted loopback servers (real sockets).

Each server answers request *k* with the *k*-th scripted action (the last one repeats):
raw bytes, bytes in pieces, or closing the connection — the framings and failures a
judge server can produce.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path

import pytest

from prm_pipeline.demo.fake_judge import FakeJudgeServer
from scoring_workers.judge.client import JudgeClient
from scoring_workers.judge.errors import JudgeRequestError
from scoring_workers.judge.settings import ClientSettings, ConnectionSettings, RequestSettings
from scoring_workers.judge.transport import HttpTransport, TransportError, check_headers
from tests.polling import poll_until
from tests.security.tlsproxy import make_pki

OK = b'{"ok": true}'
CLOSE = "close"  # close the connection instead of answering
HANG = "hang"  # never answer


def _answer(body: bytes = OK, *headers: str, status: str = "200 OK") -> bytes:
    head = [f"HTTP/1.1 {status}", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Scripted:
    """A loopback server; :attr:`requests` are ``(head, body)`` as received."""

    def __init__(self, actions: Sequence[bytes | list[bytes] | str], tls: ssl.SSLContext | None = None) -> None:
        self.actions = list(actions)
        self.tls = tls
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.eofs = 0  # connections the client closed
        self.url = ""
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        scheme = "https" if self.tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        # The client closed its connections: each handler sees the end and returns.
        await asyncio.wait_for(asyncio.gather(*self._handlers, return_exceptions=True), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                action = self.actions[min(len(self.requests), len(self.actions)) - 1]
                if action == CLOSE:
                    return
                if action == HANG:
                    try:
                        await reader.read()  # until the client gives up and closes
                    finally:
                        self.eofs += 1
                    return
                for piece in action if isinstance(action, list) else [action]:
                    if piece == CLOSE:
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)  # separate reads on the client
        finally:
            writer.close()


def _deadline(seconds: float = 5.0) -> float:
    return asyncio.get_running_loop().time() + seconds


async def _post(transport: HttpTransport, url: str, body: bytes = b'{"q": 1}', seconds: float = 5.0):
    return await transport.post(url + "/v1/chat/completions", body, _deadline(seconds))


# --------------------------------------------------------------------------- framing
async def test_content_length_answers_reuse_one_connection_and_send_the_headers():
    async with Scripted([_answer(OK, "Retry-After: 3")]) as srv:
        transport = HttpTransport({"Authorization": "Bearer k", "X-Team": "a"})
        try:
            for _ in range(3):
                assert await _post(transport, srv.url) == (200, OK, "3")
        finally:
            await transport.aclose()
    assert srv.connections == 1 and transport.connections_opened == 1
    head, body = srv.requests[0]
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    port = srv.url.rsplit(":", 1)[1]
    for line in (
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        "Content-Length: 8",
        "Authorization: Bearer k",
        "X-Team: a",
    ):
        assert line in lines, (line, lines)
    assert body == b'{"q": 1}'


async def test_chunked_answer_in_pieces_with_extensions_and_trailers():
    chunked = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b'5;ext=1\r\n{"ok"',
        b"\r\n",
        b"7\r\n: true}\r",
        b"\n0\r\nX-Trailer: 1\r\n",
        b"\r\n",
    ]
    async with Scripted([chunked, _answer(b"{}")]) as srv:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
            assert await _post(transport, srv.url) == (200, b"{}", None)  # the connection is still in step
        finally:
            await transport.aclose()
    assert srv.connections == 1


async def test_answer_delimited_by_close_and_connection_close_are_not_reused():
    to_eof = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + OK
    async with Scripted([[to_eof, CLOSE]]) as srv:  # the server closes after the body
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
            assert await _post(transport, srv.url) == (200, OK, None)
        finally:
            await transport.aclose()
    assert transport.connections_opened == 2
    async with Scripted([_answer(OK, "Connection: close")]) as srv2:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv2.url) == (200, OK, None)
            assert await _post(transport, srv2.url) == (200, OK, None)
        finally:
            await transport.aclose()
    assert transport.connections_opened == 2


async def test_interim_1xx_answers_are_skipped():
    async with Scripted([[b"HTTP/1.1 100 Continue\r\n\r\n", _answer(OK)]]) as srv:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
        finally:
            await transport.aclose()


async def test_large_request_body_arrives_whole():
    big = b'{"x": "' + b"a" * 100_000 + b'"}'
    async with Scripted([_answer(OK)]) as srv:
        transport = HttpTransport()
        try:
            await _post(transport, srv.url, big)
        finally:
            await transport.aclose()
    assert srv.requests[0][1] == big


async def test_bytes_past_the_answer_mean_the_connection_is_not_reused():
    async with Scripted([_answer(OK) + b"junk"]) as srv:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
            assert await _post(transport, srv.url) == (200, OK, None)
        finally:
            await transport.aclose()
    assert transport.connections_opened == 2


async def test_malformed_answer_is_a_transport_error():
    async with Scripted([b"SPDY/9 what\r\n\r\n"]) as srv:
        transport = HttpTransport()
        try:
            with pytest.raises(TransportError, match="malformed HTTP answer") as info:
                await _post(transport, srv.url)
        finally:
            await transport.aclose()
    assert not info.value.connect


async def test_interim_answer_in_the_same_read_as_the_final_one_and_its_headers_are_not_the_answers():
    interim = b"HTTP/1.1 100 Continue\r\nRetry-After: 9\r\n\r\n"
    async with Scripted([interim + _answer(OK), _answer(b"{}")]) as srv:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)  # not the interim answer's Retry-After
            assert await _post(transport, srv.url) == (200, b"{}", None)
        finally:
            await transport.aclose()
    assert srv.connections == 1


async def test_trailers_are_not_headers_of_the_answer():
    chunked = b"HTTP/1.1 429 Too Many\r\nRetry-After: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nRetry-After: 7\r\n\r\n"
    async with Scripted([chunked]) as srv:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (429, b"{}", "2")
        finally:
            await transport.aclose()


@pytest.mark.parametrize("framing", [b"Content-Type: application/json", b"Transfer-Encoding: chunked, identity"])
async def test_answer_to_the_end_of_the_connection_in_pieces(framing):
    # no length, and chunked not the last coding: the body ends with the connection
    head = b"HTTP/1.1 200 OK\r\n" + framing + b"\r\n\r\n"
    async with Scripted([[head, b'{"ok"', b": true}", CLOSE]]) as srv:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
        finally:
            await transport.aclose()


@pytest.mark.parametrize(
    "answer, message",
    [
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "Invalid status code"),
        (b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", "HTTP/2.0 answer"),
        # framings an old parser resolved silently (chunked won; the last length won; 101 was skipped)
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
            "Transfer-Encoding can't be present with Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Duplicate Content-Length"),
        (
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n" + _answer(OK),
            "an upgrade the client never asked for",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n", "larger than"),
        ([b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000, b"\r\n\r\n"], "head longer than 65536 bytes"),
    ],
)
async def test_answers_llhttp_refuses_are_clear_transport_errors(answer, message):
    async with Scripted([answer]) as srv:
        transport = HttpTransport()
        try:
            with pytest.raises(TransportError, match=f"^malformed HTTP answer: .*{message}") as info:
                await _post(transport, srv.url)
        finally:
            await transport.aclose()
    assert not info.value.connect and not info.value.silent and transport.open_connections == 0


# --------------------------------------------------------------------------- connections
async def test_a_reused_connection_dropped_silently_is_retried_once_on_a_new_one():
    # Request 2 arrives on the kept-alive connection and the server closes it without a
    # byte (its idle timeout fired): the transport sends it again on a fresh connection.
    async with Scripted([_answer(OK), CLOSE, _answer(b"{}")]) as srv:
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
            assert await _post(transport, srv.url) == (200, b"{}", None)
        finally:
            await transport.aclose()
    assert len(srv.requests) == 3 and transport.connections_opened == 2


async def test_a_new_connection_closed_without_an_answer_is_an_error():
    async with Scripted([CLOSE]) as srv:
        transport = HttpTransport()
        try:
            with pytest.raises(TransportError) as info:
                await _post(transport, srv.url)
        finally:
            await transport.aclose()
    assert info.value.silent and not info.value.connect and len(srv.requests) == 1


async def test_connection_closed_while_idle_is_dropped_before_sending_on_it():
    async with Scripted([[_answer(OK), CLOSE], _answer(OK)]) as srv:  # closes once it has answered
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
            await poll_until(lambda: not transport.open_connections, timeout_s=5, interval_s=0.01)
            assert transport.open_connections == 0
            assert await _post(transport, srv.url) == (200, OK, None)
        finally:
            await transport.aclose()
    assert len(srv.requests) == 2 and transport.connections_opened == 2  # nothing sent on the dead one


async def test_connection_idle_too_long_is_not_reused():
    async with Scripted([_answer(OK)]) as srv:
        transport = HttpTransport(idle_timeout_s=0.0)
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
            assert await _post(transport, srv.url) == (200, OK, None)
        finally:
            await transport.aclose()
    assert srv.connections == 2 and len(srv.requests) == 2


async def test_connect_error_says_so():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    transport = HttpTransport()
    try:
        with pytest.raises(TransportError, match="Cannot connect to host 127.0.0.1") as info:
            await _post(transport, f"http://127.0.0.1:{port}")
    finally:
        await transport.aclose()
    assert info.value.connect


async def test_deadline_cuts_the_exchange_and_closes_the_connection():
    async with Scripted([HANG]) as srv:
        transport = HttpTransport()
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(TimeoutError):
                await _post(transport, srv.url, seconds=0.2)
            assert loop.time() - start < 2.0
            await poll_until(
                lambda: srv.eofs >= 1, timeout_s=5, interval_s=0.01
            )  # the server sees the connection closed
            assert srv.eofs == 1
        finally:
            await transport.aclose()


async def test_user_info_becomes_basic_auth():
    async with Scripted([_answer(OK)]) as srv:
        transport = HttpTransport()
        try:
            await _post(transport, srv.url.replace("http://", "http://me:s%40cret@"))
        finally:
            await transport.aclose()
    expected = "Authorization: Basic " + base64.b64encode(b"me:s@cret").decode()
    assert expected in srv.requests[0][0].decode().split("\r\n")


async def test_https_verifies_the_server_certificate(tmp_path: Path, monkeypatch):
    pki = make_pki(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(pki.cert, pki.key)
    async with Scripted([_answer(OK)], tls=server_tls) as srv:
        monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))  # what the default context trusts
        transport = HttpTransport()
        try:
            assert await _post(transport, srv.url) == (200, OK, None)
            assert await _post(transport, srv.url) == (200, OK, None)
        finally:
            await transport.aclose()
        assert transport.connections_opened == 1
        monkeypatch.setenv("SSL_CERT_FILE", str(pki.other_ca))
        untrusting = HttpTransport()
        try:
            with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed") as info:
                await _post(untrusting, srv.url)
        finally:
            await untrusting.aclose()
        assert info.value.connect


# --------------------------------------------------------------------------- headers
@pytest.mark.parametrize(
    "headers, message",
    [
        ({"X-A": "v\r\nX-Injected: 1"}, "line breaks"),
        ({"Bad Name": "v"}, "not a valid HTTP header name"),
        ({"Content-Length": "3"}, "set by the client itself"),
        ({"X-A": "snow \u2603"}, "latin-1"),
    ],
)
def test_bad_headers_are_refused_at_construction(headers, message):
    with pytest.raises(ValueError, match=message):
        check_headers(headers)
    with pytest.raises(ValueError, match=message):
        JudgeClient("http://judge:30000", ClientSettings.from_flat({"headers": headers}))


# --------------------------------------------------------------------------- through JudgeClient
async def test_judge_client_maps_a_broken_answer_to_a_transport_error():
    async with Scripted([[b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n{", CLOSE]]) as srv:
        async with JudgeClient(srv.url, ClientSettings(request=RequestSettings(max_retries=2))) as client:
            with pytest.raises(JudgeRequestError) as info:
                await client.post_json("/v1/chat/completions", {"q": 1})
    assert info.value.kind == "transport" and info.value.attempts == 1  # not retried on one endpoint


async def test_trust_env_goes_through_aiohttp_and_works(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with FakeJudgeServer() as srv:
        async with JudgeClient(srv.base_url, ClientSettings(connection=ConnectionSettings(trust_env=True))) as client:
            data = await client.post_json(
                "/v1/chat/completions",
                {"model": "judge", "messages": [{"role": "user", "content": "## Next state [role: user]\nok"}]},
            )
            assert type(client._http()).__name__ == "AiohttpTransport"
    assert "\\boxed{1}" in data["choices"][0]["message"]["content"]
