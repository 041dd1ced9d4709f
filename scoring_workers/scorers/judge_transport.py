"""HTTP/1.1 for the judge client: keep-alive connections on asyncio protocols, nothing more.

Why not an HTTP library: a judge call is a small JSON POST and a small JSON answer, and
at a worker's rates (thousands of calls per second, C = 128 in flight) the library's
per-request machinery was the cost. aiohttp spent ≈ 220 µs of CPU per call in its
request and response objects, connector and stream readers — three times a bare
asyncio-streams exchange (``prm-pipeline bench judge`` measures both). An
:class:`HttpTransport` sends the same bytes at close to the bare cost: one
:class:`asyncio.Protocol` per connection, a request head built once per URL, a response
parsed from the bytes the socket delivered.

What it speaks — what judges (SGLang, vLLM, any OpenAI-compatible server) answer:

* ``POST`` with a body, HTTP/1.1, persistent connections: a pool of idle connections
  per origin, reused most-recent first; one closed by the server while idle is dropped
  (its ``connection_lost`` arrives first), one idle longer than ``idle_timeout_s`` is
  closed rather than reused (servers drop idle connections after a few seconds).
* Answers with ``Content-Length``, ``Transfer-Encoding: chunked`` or neither (read to
  the end of the connection); ``1xx`` interim answers skipped; ``Connection: close``
  and HTTP/1.0 honoured. No compression is asked for (no ``Accept-Encoding``), no
  redirect is followed (a 3xx is an answer like any other).
* ``http`` and ``https`` (verified TLS, the system's CA bundle). User info in the URL
  becomes ``Authorization: Basic``, as other clients do.
* A *reused* connection the server closed without answering a byte (it timed out the
  idle connection just as the request went out) is retried once on a new connection:
  no server answered, so nothing can have been double-counted on the client side.

What it does not do: proxies. ``JudgeClient(trust_env=True)`` (read proxy settings
from the environment) uses :class:`AiohttpTransport` instead, the same interface over
aiohttp. Every :meth:`HttpTransport.post` takes a hard deadline covering the whole
exchange (connecting, sending, the answer); an exchange cut short — deadline or
cancellation — closes its connection.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

__all__ = ["AiohttpTransport", "HttpTransport", "Transport", "TransportError", "check_headers"]

_MAX_HEAD = 64 * 1024  # status line + headers; a judge's are a few hundred bytes
_MAX_BODY = 256 * 1024 * 1024  # a teacher's log-probs of a long context are a few MB
_SMALL = 16 * 1024  # bodies up to this size are sent in one write with the head
_DEFAULT_PORTS = {"http": 80, "https": 443}


class TransportError(Exception):
    """An exchange failed below HTTP. ``connect``: no connection could be opened (nothing
    was sent, a retry is safe); otherwise the connection broke or the answer was not
    HTTP. ``silent``: the connection closed before a single byte of an answer."""

    def __init__(self, message: str, *, connect: bool = False, silent: bool = False) -> None:
        super().__init__(message)
        self.connect = connect
        self.silent = silent


Result = tuple[int, bytes, str | None]
"""``(status, body, Retry-After header or None)`` of one answer."""


class Transport:
    """What :class:`~scoring_workers.scorers.judge_http.JudgeClient` sends requests through."""

    async def post(self, url: str, body: bytes, deadline: float) -> Result:  # pragma: no cover - interface
        """POST ``body`` to ``url``; the answer, or :class:`TimeoutError` at ``deadline``
        (``loop.time()``), or :class:`TransportError`."""
        raise NotImplementedError

    async def aclose(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def check_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` as ``str -> str``, refusing what would break the request's framing: a
    name that is not an HTTP token, a value with a line break (header injection), or a
    header the transport sets itself."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        name, value = str(name), str(value)
        if not name or any(c in name for c in ' \t\r\n:()<>@,;\\"/[]?={}') or not name.isascii():
            raise ValueError(f"judge header name {name!r} is not a valid HTTP header name")
        if "\r" in value or "\n" in value or "\0" in value:
            raise ValueError(f"judge header {name!r}: the value must not contain line breaks")
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError(f"judge header {name!r}: the value must be latin-1 text") from None
        if name.lower() in ("content-length", "transfer-encoding"):
            raise ValueError(f"judge header {name!r} is set by the client itself")
        out[name] = value
    return out


# --------------------------------------------------------------------------- one connection
class _Connection(asyncio.Protocol):
    """One keep-alive connection: sends a request, parses its answer, one at a time."""

    __slots__ = ("_body", "_buf", "_chunk_left", "_chunked", "_got_bytes", "_keep_alive", "_length", "_owner",
                 "_retry_after", "_status", "_waiter", "idle_since", "open", "origin", "transport")

    def __init__(self, owner: HttpTransport, origin: tuple[str, str, int]) -> None:
        self._owner = owner
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[Result] | None = None
        self._reset()

    def _reset(self) -> None:
        self._buf = b""
        self._status = 0  # 0: the head is not parsed yet
        self._length = -1  # Content-Length, -1: none
        self._chunked = False
        self._chunk_left = -1  # bytes of the current chunk still to read (+2 for its CRLF); -1: a size line next
        self._body = bytearray()
        self._keep_alive = True
        self._retry_after: str | None = None
        self._got_bytes = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True
        self._owner._conns.add(self)

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        self._got_bytes = True
        try:
            self._feed(data)
        except ValueError as exc:
            self._fail(TransportError(f"malformed HTTP answer: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        self._closed("the server closed the connection")
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(f"connection lost: {exc}" if exc else "the server closed the connection")
        self._owner._conns.discard(self)

    # -- requests
    def exchange(self, request: bytes, body: bytes | None) -> asyncio.Future[Result]:
        """Send ``request`` (and ``body`` when sent separately); the future is its answer."""
        waiter = self._waiter = self._owner._loop.create_future()
        self._reset()
        transport = self.transport
        assert transport is not None
        transport.write(request)
        if body is not None:
            transport.write(body)
        return waiter

    @property
    def reusable(self) -> bool:
        return self.open and self._keep_alive and self._waiter is None

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def _closed(self, why: str) -> None:
        self.open = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._status and self._length < 0 and not self._chunked:
            self._keep_alive = False
            self._done()  # an answer delimited by the end of the connection
            return
        self._fail(TransportError(why, silent=not self._got_bytes))

    def _fail(self, error: TransportError) -> None:
        waiter, self._waiter = self._waiter, None
        self._keep_alive = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _done(self, body: bytes | None = None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, bytes(self._body) if body is None else body, self._retry_after))

    # -- parsing
    def _feed(self, data: bytes) -> None:
        if not self._status:
            buf = self._buf + data if self._buf else data
            while True:  # 1xx interim answers come before the final one
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > _MAX_HEAD:
                        raise ValueError(f"head longer than {_MAX_HEAD} bytes")
                    self._buf = buf
                    return
                self._head(buf[:end])
                buf = buf[end + 4:]
                if self._status >= 200:
                    break
                self._status = 0
            self._buf = b""
            if self._status in (204, 304):
                self._length = 0
            data = buf
        if self._chunked:
            self._feed_chunks(data)
            return
        body = self._body
        length = self._length
        if not body and len(data) >= length >= 0:  # the whole body in one read: no copy
            if len(data) > length:
                data = data[:length]
                self._keep_alive = False  # bytes past the answer: out of step, do not reuse
            self._done(data)
            return
        if data:
            body += data
        if length >= 0:
            if len(body) >= self._length:
                if len(body) > self._length:
                    del body[self._length:]
                    self._keep_alive = False  # bytes past the answer: out of step, do not reuse
                self._done()
        elif len(body) > _MAX_BODY:
            raise ValueError(f"body larger than {_MAX_BODY} bytes")

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        self._status = int(parts[1])
        keep_alive = parts[0] != b"HTTP/1.0"
        self._length = -1
        self._chunked = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ValueError(f"bad header line {line[:80]!r}")
            key = name.strip().lower()
            if key == b"content-length":
                length = value.strip()
                if not length.isdigit():
                    raise ValueError(f"bad Content-Length {length[:40]!r}")
                self._length = int(length)
                if self._length > _MAX_BODY:
                    raise ValueError(f"body of {self._length} bytes, larger than {_MAX_BODY}")
            elif key == b"transfer-encoding":
                if value.strip().lower().endswith(b"chunked"):
                    self._chunked = True
            elif key == b"connection":
                tokens = value.lower()
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
            elif key == b"retry-after":
                self._retry_after = value.strip().decode("latin-1")
        if self._chunked:
            self._length = -1
        self._keep_alive = self._keep_alive and keep_alive

    def _feed_chunks(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        body = self._body
        pos = 0
        while True:
            left = self._chunk_left
            if left == -2:  # after the last chunk: trailers up to an empty line
                if buf.startswith(b"\r\n", pos):
                    if len(buf) > pos + 2:
                        self._keep_alive = False
                    self._buf = b""
                    self._done()
                    return
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                if len(buf) > end + 4:
                    self._keep_alive = False
                self._buf = b""
                self._done()
                return
            if left < 0:  # a size line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                size_text = buf[pos:end].split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise ValueError(f"bad chunk size {size_text[:40]!r}") from None
                if size < 0 or len(body) + size > _MAX_BODY:
                    raise ValueError(f"body larger than {_MAX_BODY} bytes")
                pos = end + 2
                self._chunk_left = -2 if size == 0 else size + 2
                continue
            if len(buf) - pos < left:
                if left > 2:  # take what there is of the chunk's data, keep the rest pending
                    take = min(len(buf) - pos, left - 2)
                    body += buf[pos:pos + take]
                    pos += take
                    self._chunk_left = left - take
                break
            if left > 2:
                body += buf[pos:pos + left - 2]
            if buf[pos + left - 2:pos + left] != b"\r\n":
                raise ValueError("chunk not followed by CRLF")
            pos += left
            self._chunk_left = -1
        self._buf = buf[pos:]
        if len(self._buf) > _MAX_HEAD:
            raise ValueError("chunk size line or trailers too long")


def _expire(waiter: asyncio.Future[Result]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


async def _until(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[Result], deadline: float) -> Result:
    """``await waiter``, failing it with :class:`TimeoutError` at ``deadline``."""
    timer = loop.call_at(deadline, _expire, waiter)
    try:
        return await waiter
    finally:
        timer.cancel()


# --------------------------------------------------------------------------- the pool
@dataclass(frozen=True, slots=True)
class _Target:
    origin: tuple[str, str, int]  # scheme, host, port
    host: str  # what to connect to (an IPv6 address without brackets)
    port: int
    tls: bool
    head: bytes  # request line and headers, up to and including "Content-Length: "


class HttpTransport(Transport):
    """HTTP/1.1 keep-alive connections of one judge client (module docstring).

    Args:
        headers: sent with every request (checked by :func:`check_headers`).
        idle_timeout_s: an idle connection older than this is closed, not reused.
    """

    def __init__(self, headers: Mapping[str, str] | None = None, *, idle_timeout_s: float = 30.0) -> None:
        self._headers = check_headers(headers or {})
        self.idle_timeout_s = idle_timeout_s
        self._targets: dict[str, _Target] = {}
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._conns: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._loop: Any = None
        self._closed = False
        self.connections_opened = 0
        """How many connections this transport opened (tests check reuse by it)."""

    @property
    def open_connections(self) -> int:
        """Connections open now, idle or busy."""
        return len(self._conns)

    def _target(self, url: str) -> _Target:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        host = parts.hostname
        port = parts.port or _DEFAULT_PORTS[scheme]
        shown = f"[{host}]" if ":" in host else host
        host_header = shown if port == _DEFAULT_PORTS[scheme] else f"{shown}:{port}"
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        if not path.isascii() or " " in path:
            path = quote(path, safe="/%?=&;:@!$'()*+,~-._")
        headers = {"host": ("Host", host_header), "user-agent": ("User-Agent", "prm-pipeline-judge"),
                   "accept": ("Accept", "application/json")}
        if parts.username is not None:
            user_info = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers["authorization"] = ("Authorization", "Basic " + base64.b64encode(user_info.encode()).decode())
        for name, value in self._headers.items():
            headers[name.lower()] = (name, value)  # the configured headers win, as a session's do
        headers["content-type"] = ("Content-Type", "application/json")  # the body is JSON, whatever was set
        lines = [f"POST {path} HTTP/1.1", *(f"{name}: {value}" for name, value in headers.values())]
        try:
            head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError(f"judge request headers for {url!r} must be latin-1 text") from None
        target = _Target((scheme, host.lower(), port), host, port, scheme == "https", head)
        self._targets[url] = target
        return target

    async def _connect(self, target: _Target, deadline: float) -> _Connection:
        loop = self._loop
        context = None
        if target.tls:
            context = self._ssl
            if context is None:
                context = self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout_at(deadline):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, target.origin), target.host, target.port,
                    ssl=context, server_hostname=target.host if target.tls else None,
                )
        except OSError as exc:
            raise TransportError(
                f"Cannot connect to host {target.origin[1]}:{target.port} "
                f"ssl:{'default' if target.tls else 'False'} [{exc.strerror or exc}]",
                connect=True,
            ) from None
        self.connections_opened += 1
        return conn

    def _pop_idle(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_ok = time.monotonic() - self.idle_timeout_s
        while idle:
            conn = idle.pop()
            if conn.open and conn.idle_since >= oldest_ok:
                return conn
            conn.close()
        return None

    async def post(self, url: str, body: bytes, deadline: float) -> Result:
        """POST ``body`` to ``url``; ``(status, body, Retry-After)`` of the answer.

        ``deadline`` (``loop.time()``) bounds the whole exchange, connecting included: a
        timer on the answer's future rather than an ``asyncio.timeout`` context, which
        costs several times more per call. An exchange cut short closes its connection.

        Raises:
            TimeoutError: no answer by ``deadline``.
            TransportError: no connection (``connect``), or it broke before the answer.
        """
        if self._closed:
            raise RuntimeError("the judge transport is closed")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        target = self._targets.get(url) or self._target(url)
        size = b"%d\r\n\r\n" % len(body)
        if len(body) <= _SMALL:
            request, rest = target.head + size + body, None
        else:
            request, rest = target.head + size, body
        conn = self._pop_idle(target.origin)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(target, deadline)
        try:
            try:
                result = await _until(loop, conn.exchange(request, rest), deadline)
            except TransportError as exc:
                if not (reused and exc.silent):
                    raise
                conn.close()  # the server dropped the idle connection as we sent: once more, anew
                conn = await self._connect(target, deadline)
                result = await _until(loop, conn.exchange(request, rest), deadline)
        except BaseException:
            conn.close()
            raise
        if conn.reusable and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(target.origin, []).append(conn)
        else:
            conn.close()
        return result

    async def aclose(self) -> None:
        """Close every connection (idempotent); requests still in flight fail."""
        self._closed = True
        self._idle.clear()
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.sleep(0)  # let the transports' close callbacks run on this loop


# --------------------------------------------------------------------------- through proxies
class AiohttpTransport(Transport):
    """The same interface over :mod:`aiohttp`, for ``trust_env=True``: proxy settings
    (``HTTP(S)_PROXY``, ``NO_PROXY``) and ``.netrc`` from the environment. Slower per
    call; imported only when used."""

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        self._headers = check_headers(headers or {})
        self._session: Any = None
        self._closed = False

    async def post(self, url: str, body: bytes, deadline: float) -> Result:
        import aiohttp

        if self._closed:
            raise RuntimeError("the judge transport is closed")
        session = self._session
        if session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            session = self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, trust_env=True, timeout=aiohttp.ClientTimeout(total=None)
            )
        try:
            async with asyncio.timeout_at(deadline), \
                    session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                return response.status, await response.read(), response.headers.get("Retry-After")
        except aiohttp.ClientConnectorError as exc:
            raise TransportError(str(exc), connect=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()
