"""``prm-pipeline gateway``: process rewards over HTTP for trainers that call a reward URL.

OpenRLHF (``--reward.remote_url``) and slime / OpenClaw-RL (``--rm-type remote_rm``)
reach reward models over HTTP with text; other trainers can send token ids. The gateway
turns each request into trajectories through :class:`shaper.reward_client.RewardClient`
(published — durably — before it answers), waits for the group's verdict and answers in
the caller's shape:

* ``POST /openrlhf`` — OpenRLHF's remote-RM JSON: ``{"query", "prompts", "labels"}`` in,
  ``{"rewards", "scores", "extra_logs"}`` out;
* ``POST /slime`` — slime's ``{"prompt", "response", "label"}`` in, ``{"score", ...}`` out
  (these two answer through :mod:`shaper.integrations.core`, as the in-process OpenRLHF
  and slime hooks do);
* ``POST /v1/score`` — token ids in (one sample or a whole group), per-token rewards out;
* ``POST /v1/turn`` / ``POST /v1/end`` — a streamed session, turn by turn (one JSONL
  ``turn`` / ``end`` line each, docs/jsonl.md); ``/v1/end`` answers with the group's verdict;
* ``GET /healthz``, ``/readyz``, ``/metrics``, ``/openapi.json``.

Every body is decoded straight into a declared msgspec struct (:mod:`prm_pipeline.gateway_api`,
which also generates the OpenAPI document): a body that is not exactly data of that shape is a
400 naming the field, and every error (404 and 405 included) is ``{"error": ...}``.

A group that was not accepted is still a 200: its ``status``, its ``reason_code`` (the
verdict's registered code, :mod:`infra.reasons`, for programs) and its ``reason`` (text
for people) come with every answer.

Security (docs/security.md): loopback unless told otherwise; bearer tokens compared in
constant time; TLS when given a certificate; body size, items per request and in-flight
requests (per client and in all) are bounded; a slow body times out; idle connections close
(``keepalive_timeout_s``) and open connections per client address are capped; requests carry
samples only, never configuration; neither tokens nor text reach logs or metric labels (a
request aiohttp cannot parse, an oversized header say, is answered 431/400 without repeating any
of its bytes, in the answer or the log).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import ssl
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infra import jsonl
from infra.bounded_json import JSONBoundsError, decode_json
from infra.config import ConfigError, GatewayConfig, PipelineConfig
from infra.errors import WireError
from infra.ports import port_unavailable
from infra.schema import SessionEnd, SessionTurn
from prm_pipeline.gateway_api import (
    MAX_BODY_DEPTH,
    MAX_ITEMS,
    EndResponse,
    Error,
    OpenRLHFRequest,
    OpenRLHFResponse,
    ScoredSample,
    ScoreRequest,
    ScoreResponse,
    SlimeRequest,
    SlimeResponse,
    Status,
    TurnPublished,
    openapi_document,
)
from shaper.integrations.core import (
    PUBLISHED,
    AdapterSettings,
    VerdictTimeout,
    check_late,
    openrlhf_scores,
    score_groups,
    slime_scores,
)
from shaper.reward_client import RewardClient, Sample, SampleReward
from shaper.text_rewards import load_tokenizer, prompt_messages, samples_from_queries

log = logging.getLogger(__name__)
_ERROR_TEXT = 300  # characters of an error line kept (msgspec quotes an unknown field's name)


class BadRequest(WireError, ValueError):
    """A request the gateway refuses with 400; the message names the field."""

    status = 400


class SlowBody(BadRequest):
    """The request body did not arrive within ``gateway.read_timeout_s`` (408)."""

    status = 408


class BodyTooLarge(BadRequest):
    """The request body is over ``gateway.max_body_bytes`` (413)."""

    status = 413


# --------------------------------------------------------------------------- auth and limits
def load_tokens(cfg: GatewayConfig, environ: dict[str, str] | os._Environ[str] = os.environ) -> list[bytes]:
    """Bearer tokens from ``auth_tokens_env`` (comma-separated) and ``auth_tokens_file`` (one per line)."""
    tokens: list[str] = []
    if cfg.auth_tokens_env:
        value = environ.get(cfg.auth_tokens_env)
        if value is None:
            raise ConfigError(f"gateway.auth_tokens_env names {cfg.auth_tokens_env!r}, which is not set")
        tokens += value.split(",")
    if cfg.auth_tokens_file:
        path = Path(cfg.auth_tokens_file)
        if not path.is_file():
            raise ConfigError(f"gateway.auth_tokens_file: {str(path)!r} does not exist")
        tokens += path.read_text().splitlines()
    tokens = [t.strip() for t in tokens if t.strip()]
    if (cfg.auth_tokens_env or cfg.auth_tokens_file) and not tokens:
        raise ConfigError("gateway: authentication is configured but no token was found (empty variable or file)")
    return [t.encode() for t in tokens]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class _Limits:
    per_client: Tally[str]
    total: int = 0


# --------------------------------------------------------------------------- request parsing
_MAX_BODY_BYTES = GatewayConfig().max_body_bytes
""":func:`decode`'s size bound when none is given (the gateway passes ``gateway.max_body_bytes``)."""


def decode(raw: bytes, kind: type[msgspec.Struct], *, max_bytes: int = _MAX_BODY_BYTES) -> Any:
    """``raw`` as ``kind``, or :class:`BadRequest` whose message names the field (msgspec's path).

    Decoded by :func:`infra.bounded_json.decode_json` (the registry's decoder too): the size and
    then the nesting (:data:`MAX_BODY_DEPTH`) are checked on the bytes before decoding, since the
    decoder recurses per level, so nothing deeper ever reaches it.
    """
    try:
        return decode_json(raw, kind, what="body", max_bytes=max_bytes, max_depth=MAX_BODY_DEPTH)
    except JSONBoundsError as exc:
        raise _refusal(exc, max_bytes=max_bytes) from None


def _refusal(exc: JSONBoundsError, *, max_bytes: int) -> BadRequest:
    """The gateway's answer to a body :func:`decode_json` refused, by its ``reason``."""
    if exc.reason == "shape":  # msgspec's message ends with the path
        message = exc.detail
        return BadRequest(_one_line(message if " - at `$" in message else f"{message} - at `$`"))
    if exc.reason == "syntax":  # msgspec says where, never what
        return BadRequest(f"body is not valid JSON ({exc.detail})")
    if exc.reason == "size":
        return BodyTooLarge(f"request body over gateway.max_body_bytes={max_bytes}")
    return BadRequest(f"body nests JSON deeper than {MAX_BODY_DEPTH} levels - at `$`")


def _one_line(message: str) -> str:
    """An error line of at most ``_ERROR_TEXT`` characters, keeping its end (the path)."""
    message = " ".join(message.split())
    if len(message) <= _ERROR_TEXT:
        return message
    return f"{message[: _ERROR_TEXT // 2]}…{message[-_ERROR_TEXT // 2 :]}"


def _check_items(n: int, field: str, limit: int) -> None:
    if n > limit:
        raise BadRequest(f"{field} has {n} items, over the limit of {limit} (gateway.max_items) - at `$.{field}`")


def _json(body: msgspec.Struct, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers, content_type="application/json")


# --------------------------------------------------------------------------- the service
class Gateway:
    """The HTTP service around one :class:`RewardClient` (one Kafka producer and verdict reader)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        client: RewardClient | None = None,
        environ: dict[str, str] | os._Environ[str] = os.environ,
    ) -> None:
        self.cfg = cfg
        self.gw = cfg.gateway
        if self.gw.max_items > MAX_ITEMS:
            raise ConfigError(
                f"gateway.max_items={self.gw.max_items} is over {MAX_ITEMS}, the most the gateway's "
                "published request schema allows (docs/integrations/gateway-openapi.json)"
            )
        self.tokenizer = load_tokenizer(self.gw.tokenizer)
        self._tokens = load_tokens(self.gw, environ)
        self.client = client or RewardClient(
            cfg, verdict_timeout_s=self.gw.verdict_timeout_s, decode=self.tokenizer.decode
        )
        self._limits = _Limits(per_client=Tally())
        self._settings = AdapterSettings.from_gateway(self.gw)  # /v1/score's late-verdict policy
        self._openapi = msgspec.json.encode(openapi_document())
        self.ready = False
        r = self.registry = CollectorRegistry()
        self.requests = Counter("prm_gateway_requests", "Requests answered", ["route", "code"], registry=r)
        self.latency = Histogram(
            "prm_gateway_request_seconds",
            "Request latency (verdict wait included)",
            ["route"],
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.in_flight = Gauge("prm_gateway_in_flight", "Requests being answered", registry=r)
        self.samples = Counter("prm_gateway_samples", "Samples scored, by verdict status", ["status"], registry=r)
        self.connections = _ConnectionCap(
            self.gw.max_connections_per_client,
            Counter(
                "prm_gateway_connections_refused",
                "Connections refused: over max_connections_per_client from their address",
                registry=r,
            ),
        )

    @property
    def authenticated(self) -> bool:
        return bool(self._tokens)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.gw.max_body_bytes, middlewares=[self._guard])
        app.add_routes(
            [
                web.post("/openrlhf", self._openrlhf),
                web.post("/slime", self._slime),
                web.post("/v1/score", self._score),
                web.post("/v1/turn", self._turn),
                web.post("/v1/end", self._end),
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/metrics", self._metrics),
                web.get("/openapi.json", self._openapi_json),
            ]
        )
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        await self.client.start()
        self.ready = True

    async def _on_cleanup(self, _app: web.Application) -> None:
        self.ready = False
        await self.client.aclose()

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = request.path if request.path in ("/openrlhf", "/slime", "/v1/score", "/v1/turn", "/v1/end") else "other"
        if request.path in ("/healthz", "/readyz"):  # probes: no auth, no limits (they hold nothing)
            try:
                return await handler(request)
            except web.HTTPException as exc:  # 405: a POST on a probe
                return _http_error(exc)
        t0 = time.perf_counter()
        response = await self._guarded(request, handler, route)
        self.requests.labels(route, str(response.status)).inc()
        if route != "other":
            self.latency.labels(route).observe(time.perf_counter() - t0)
        return response

    async def _guarded(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]], route: str
    ) -> web.StreamResponse:
        if self._tokens and not self._authorized(request.headers.get("Authorization", "")):
            return _error(401, "unauthorized", headers={"WWW-Authenticate": "Bearer"})
        if route == "other":  # /metrics, /openapi.json (authenticated when tokens are set), 404s and 405s
            try:
                return await handler(request)
            except web.HTTPException as exc:
                return _http_error(exc)
        client = request.remote or "?"
        limits = self._limits
        if limits.total >= self.gw.max_in_flight or limits.per_client[client] >= self.gw.max_in_flight_per_client:
            return _error(429, "too many requests in flight; retry later", headers={"Retry-After": "1"})
        limits.total += 1
        limits.per_client[client] += 1
        self.in_flight.inc()
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over gateway.max_body_bytes={self.gw.max_body_bytes}")
        except web.HTTPException as exc:  # 405: a GET on a POST route
            return _http_error(exc)
        finally:
            limits.total -= 1
            limits.per_client[client] -= 1
            if not limits.per_client[client]:
                del limits.per_client[client]
            self.in_flight.dec()

    def _authorized(self, header: str) -> bool:
        scheme, _, presented = header.partition(" ")
        given = presented.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for token in self._tokens:  # every token compared, in constant time: no hint which part was wrong
            ok |= hmac.compare_digest(given, token)
        return ok

    async def _body(self, request: web.Request, kind: Any) -> Any:
        """The request body, bounded in size and time, decoded as ``kind`` (a 400 naming the field if not)."""
        if request.content_length is not None and request.content_length > self.gw.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.gw.max_body_bytes, actual_size=request.content_length)
        try:
            raw = await asyncio.wait_for(request.read(), self.gw.read_timeout_s)
        except TimeoutError:
            raise SlowBody(
                f"request body did not arrive within gateway.read_timeout_s={self.gw.read_timeout_s:g}s"
            ) from None
        except HttpProcessingError as exc:  # a broken chunked or compressed body; its text quotes the bytes
            raise BadRequest(f"request body is malformed ({type(exc).__name__})") from None
        return decode(raw, kind, max_bytes=self.gw.max_body_bytes)

    # ------------------------------------------------------------------ scoring
    def _observe(self, reward: SampleReward) -> None:
        self.samples.labels(reward.status).inc()

    # ------------------------------------------------------------------ routes
    async def _openrlhf(self, request: web.Request) -> web.Response:
        body: OpenRLHFRequest = await self._body(request, OpenRLHFRequest)
        _check_items(len(body.query), "query", self.gw.max_items)
        try:
            samples = samples_from_queries(body.query, body.prompts, self.tokenizer)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        try:
            answer = await openrlhf_scores(self.client, self.gw, samples, prefix="gw", observe=self._observe)
        except VerdictTimeout as exc:
            return _error(504, str(exc))
        return _json(msgspec.convert(answer, OpenRLHFResponse))

    async def _slime(self, request: web.Request) -> web.Response:
        body: SlimeRequest = await self._body(request, SlimeRequest)
        try:  # the same rule as the in-process slime hook (the body's shape is already checked)
            prompt, messages = prompt_messages(msgspec.to_builtins(body.prompt), "prompt")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        sample = Sample(
            prompt_ids=self.tokenizer.encode(prompt),
            response_ids=self.tokenizer.encode(body.response),
            messages=messages,
        )
        try:
            (answer,) = await slime_scores(self.client, self.gw, [sample], prefix="gw", observe=self._observe)
        except VerdictTimeout as exc:
            return _error(504, str(exc))
        return _json(msgspec.convert(answer, SlimeResponse))

    async def _score(self, request: web.Request) -> web.Response:
        body: ScoreRequest = await self._body(request, ScoreRequest)
        _check_items(len(body.samples), "samples", self.gw.max_items)
        samples = [
            Sample(
                prompt_ids=s.prompt_ids,
                response_ids=s.response_ids,
                response_logprobs=s.response_logprobs,
                response_mask=s.response_mask,
                outcome_reward=s.outcome_reward,
                messages=s.messages,
                truncated=s.truncated,
                policy_version=s.policy_version,
                is_eval=s.is_eval,
            )
            for s in body.samples
        ]
        (rewards,) = await score_groups(self.client, [samples], prefix="gw", observe=self._observe)
        try:
            check_late(rewards, self._settings)
            statuses = [_answered(r) for r in rewards]
        except VerdictTimeout as exc:
            return _error(504, str(exc))
        return _json(
            ScoreResponse(
                group_id=rewards[0].group_id,
                status=statuses[0],
                reason_code=rewards[0].reason_code,
                reason=rewards[0].reason,
                samples=[
                    ScoredSample(
                        trajectory_id=r.trajectory_id,
                        status=status,
                        outcome=r.outcome,
                        token_rewards=r.token_rewards.tolist(),
                        turn_rewards=list(r.turn_rewards),
                    )
                    for r, status in zip(rewards, statuses)
                ],
            )
        )

    async def _streamed(self, request: web.Request, kind: type[SessionTurn] | type[SessionEnd]) -> Any:
        """The body as one JSONL line of ``kind`` (docs/jsonl.md): the same strict rules as
        ``prm-pipeline publish``, a 400 naming the field otherwise."""
        try:
            message = jsonl.parse(await self._body(request, dict[str, Any]))
        except ValueError as exc:  # JsonlError and the wire structs' rules
            raise BadRequest(_one_line(str(exc))) from None
        if not isinstance(message, kind):
            raise BadRequest(f"kind: this route takes a `{'turn' if kind is SessionTurn else 'end'}` line")
        return message

    async def _turn(self, request: web.Request) -> web.Response:
        turn: SessionTurn = await self._streamed(request, SessionTurn)
        try:
            await self.client.publish_turn(turn)
        except ValueError as exc:  # another experiment's, or over the record limit
            raise BadRequest(_one_line(str(exc))) from None
        return _json(
            TurnPublished(
                published="turn", trajectory_id=turn.trajectory_id, interaction_id=turn.interaction.interaction_id
            )
        )

    async def _end(self, request: web.Request) -> web.Response:
        end: SessionEnd = await self._streamed(request, SessionEnd)
        try:
            await self.client.end_session(end)
        except ValueError as exc:
            raise BadRequest(_one_line(str(exc))) from None
        verdict = await self.client.verdict(end.group_id, self.gw.verdict_timeout_s)
        if verdict is None:
            return _error(
                504,
                f"no verdict for group {end.group_id!r} within gateway.verdict_timeout_s="
                f"{self.gw.verdict_timeout_s:g}s (the session is published)",
            )
        return _json(
            EndResponse(
                group_id=verdict.group_id, status=verdict.status, reason_code=verdict.reason_code, reason=verdict.reason
            )
        )

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503, text="ready\n" if self.ready else "starting\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _openapi_json(self, _request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")


def _answered(reward: SampleReward) -> Status:
    """A member's status as ``/v1/score`` reports it: a verdict's, never ``timeout`` (a late
    verdict is a 504, :func:`~shaper.integrations.core.check_late`)."""
    match reward.status:
        case "accepted" | "rejected" | "discarded" as status:
            return status
    raise VerdictTimeout(reward.reason + PUBLISHED)


def _error(status: int, message: str, *, headers: dict[str, str] | None = None) -> web.Response:
    return _json(Error(message), status=status, headers=headers)


def _http_error(exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (404, 405, ...) as JSON like every other error; the path is not repeated."""
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _error(405, f"method not allowed on this route; it takes {allowed}", headers={"Allow": allowed})
    if isinstance(exc, web.HTTPNotFound):
        return _error(
            404, "no such route (POST /openrlhf, /slime, /v1/score; GET /healthz, /readyz, /metrics, /openapi.json)"
        )
    return _error(exc.status, exc.reason)


# --------------------------------------------------------------------------- requests aiohttp cannot parse
_HTTP_LOG = logging.getLogger(f"{__name__}.http")


class _NoRequestBytes(logging.Filter):
    """aiohttp's parse errors quote the raw request (``Got more than 8190 bytes when reading:
    b'Bearer <token>...'``): on the gateway's protocol logger such a record keeps only the
    error's class name."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "refused a malformed HTTP request (%s)", (type(exc).__name__,)
            record.exc_info, record.exc_text = None, None
        return True


_HTTP_LOG.addFilter(_NoRequestBytes())


class _ConnectionCap:
    """Open connections per client address (``gateway.max_connections_per_client``): one
    address cannot hold every socket of the process with idle connections. A connection over
    the cap is answered 429 before anything is read, and closed."""

    def __init__(self, limit: int, refused: Counter) -> None:
        self.limit, self.refused = limit, refused
        self.open: Tally[str | None] = Tally()
        self._address: dict[web.RequestHandler, str | None] = {}
        body = msgspec.json.encode(
            Error(
                f"too many connections from this address (over {limit}, "
                "gateway.max_connections_per_client); reuse or close idle ones"
            )
        )
        self.answer = (
            b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    def admit(self, handler: web.RequestHandler, transport: asyncio.BaseTransport) -> bool:
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else None
        if self.open[address] >= self.limit:
            self.refused.inc()
            return False
        self.open[address] += 1
        self._address[handler] = address
        return True

    def release(self, handler: web.RequestHandler) -> None:
        if (address := self._address.pop(handler, ...)) is not ...:
            self.open[address] -= 1
            if not self.open[address]:
                del self.open[address]


class _Protocol(web.RequestHandler):
    """aiohttp's connection handler, answering a request it could not parse (an oversized or
    malformed header line, too many headers, a bad request line) with a JSON error that repeats
    none of the request's bytes, and logging only the error's class. aiohttp's own answer is
    text quoting the offending line, a bearer token included. A connection over its address's
    cap (:class:`_ConnectionCap`) is answered 429 and closed before aiohttp starts serving it."""

    __slots__ = ()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        assert isinstance(server, _Server)
        if not server.cap.admit(self, transport):
            cast(asyncio.Transport, transport).write(server.cap.answer)
            transport.close()
            self._manager = None  # aiohttp's connection_lost then has nothing to undo: nothing was started
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if isinstance(self._manager, _Server):
            self._manager.cap.release(self)
        super().connection_lost(exc)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: an answer already started cannot be replaced
            raise ConnectionError("response already sent; cannot send the error")
        if status >= 500:  # a bug in a handler (the middleware answers every expected failure)
            log.error("gateway: unexpected %s while answering a request", type(exc).__name__, exc_info=exc)
            answer = _error(500, "internal error")
        else:
            too_large = isinstance(exc, LineTooLong) or "too many headers" in str(getattr(exc, "message", "")).lower()
            _HTTP_LOG.info("refused a malformed HTTP request: %s (%d)", type(exc).__name__, 431 if too_large else 400)
            answer = (
                _error(
                    431,
                    f"request header fields too large: a request line or header over "
                    f"{self.max_field_size} bytes, or over {self.max_headers} headers",
                )
                if too_large
                else _error(400, "malformed HTTP request")
            )
        answer.force_close()
        return answer


class _Server(web.Server):
    """aiohttp's server, whose connections use :class:`_Protocol` (the class swap is layout-safe:
    ``cap``, set by :class:`_Runner`, is an instance attribute)."""

    cap: _ConnectionCap

    def __call__(self) -> web.RequestHandler:
        protocol = super().__call__()
        protocol.__class__ = _Protocol
        return protocol


class _Runner(web.AppRunner):
    """:class:`web.AppRunner` serving through :class:`_Server`, capping connections with ``cap``."""

    def __init__(self, app: web.Application, *, cap: _ConnectionCap, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._cap = cap

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        assert isinstance(server, _Server)  # for the type checker, which does not follow a class swap
        server.cap = self._cap
        return server


def ssl_context(gw: GatewayConfig) -> ssl.SSLContext | None:
    if not gw.tls_certfile and not gw.tls_keyfile:
        return None
    if not (gw.tls_certfile and gw.tls_keyfile):
        raise ConfigError("gateway: TLS needs both tls_certfile and tls_keyfile")
    for key, path in (("tls_certfile", gw.tls_certfile), ("tls_keyfile", gw.tls_keyfile)):
        if not Path(path).is_file():
            raise ConfigError(f"gateway.{key}: {path!r} does not exist")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(gw.tls_certfile, gw.tls_keyfile)
    return ctx


def check_exposure(gw: GatewayConfig, *, authenticated: bool, allow_unauthenticated: bool) -> None:
    """Refuse to listen beyond loopback without authentication unless explicitly allowed."""
    if is_loopback(gw.host) or authenticated:
        return
    if not allow_unauthenticated:
        raise ConfigError(
            f"gateway: listening on {gw.host} without authentication; set gateway.auth_tokens_env "
            "or auth_tokens_file, or pass --allow-unauthenticated (behind a network policy)"
        )
    log.warning(
        "gateway listens on %s WITHOUT authentication (--allow-unauthenticated): anything that reaches "
        "this port can publish trajectories",
        gw.host,
    )


async def serve(
    cfg: PipelineConfig,
    stop: asyncio.Event,
    *,
    allow_unauthenticated: bool = False,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run the gateway until ``stop`` is set."""
    gateway = Gateway(cfg)
    check_exposure(cfg.gateway, authenticated=gateway.authenticated, allow_unauthenticated=allow_unauthenticated)
    # access logs would carry client addresses only; parse errors go to a logger that drops the request's bytes
    runner = _Runner(
        gateway.app(),
        cap=gateway.connections,
        access_log=None,
        logger=_HTTP_LOG,
        keepalive_timeout=cfg.gateway.keepalive_timeout_s,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.gateway.host, cfg.gateway.port, ssl_context=ssl_context(cfg.gateway))
        try:
            await site.start()
        except OSError as exc:  # one line naming the setting, exit 2 (prm_pipeline.cli), not a traceback
            raise port_unavailable(
                exc, cfg.gateway.host, cfg.gateway.port, "gateway --host/--port (gateway.host, gateway.port)"
            ) from None
        port = runner.addresses[0][1]
        scheme = "https" if cfg.gateway.tls_certfile else "http"
        log.info(
            "gateway listening on %s://%s:%d (tokenizer %s, auth %s)",
            scheme,
            cfg.gateway.host,
            port,
            gateway.tokenizer.name,
            "on" if gateway.authenticated else "off",
        )
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
    finally:
        await runner.cleanup()
