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
* ``GET /healthz``, ``/readyz``, ``/metrics``.

A group that was not accepted is still a 200: its ``status``, its ``reason_code`` (the
verdict's registered code, :mod:`infra.reasons`, for programs) and its ``reason`` (text
for people) come with every answer.

Security (docs/security.md): loopback unless told otherwise; bearer tokens compared in
constant time; TLS when given a certificate; body size, items per request and in-flight
requests (per client and in all) are bounded; a slow body times out; requests carry
samples only, never configuration; neither tokens nor text reach logs or metric labels.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import ssl
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infra.config import ConfigError, GatewayConfig, PipelineConfig
from infra.errors import WireError
from shaper.integrations.core import (
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

_MAX_TOKEN_ID = 2**31 - 1


class BadRequest(WireError, ValueError):
    """A request the gateway refuses with 400; the message names the field."""

    status = 400


class SlowBody(BadRequest):
    """The request body did not arrive within ``gateway.read_timeout_s`` (408)."""

    status = 408


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
def _ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"{field} must be a list of integer token ids")
    if value and (min(value) < 0 or max(value) > _MAX_TOKEN_ID):
        raise BadRequest(f"{field}: token ids must lie in [0, 2^31)")
    return value


def _floats(value: Any, field: str, n: int) -> list[float]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"{field} must be a list of numbers")
    if len(value) != n:
        raise BadRequest(f"{field} has {len(value)} values for {n} response tokens")
    if not np.isfinite(np.asarray(value, dtype=np.float64)).all():
        raise BadRequest(f"{field} must be finite")
    return value


def _list(body: dict[str, Any], field: str, limit: int, *, required: bool = True) -> list[Any] | None:
    value = body.get(field)
    if value is None and not required:
        return None
    if not isinstance(value, list):
        raise BadRequest(f"{field} must be a list")
    if not value:
        raise BadRequest(f"{field} must not be empty")
    if len(value) > limit:
        raise BadRequest(f"{field} has {len(value)} items, over the limit of {limit} (gateway.max_items)")
    return value


# --------------------------------------------------------------------------- the service
class Gateway:
    """The HTTP service around one :class:`RewardClient` (one Kafka producer and verdict reader)."""

    def __init__(self, cfg: PipelineConfig, *, client: RewardClient | None = None,
                 environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
        self.cfg = cfg
        self.gw = cfg.gateway
        self.tokenizer = load_tokenizer(self.gw.tokenizer)
        self._tokens = load_tokens(self.gw, environ)
        self.client = client or RewardClient(cfg, verdict_timeout_s=self.gw.verdict_timeout_s,
                                             decode=self.tokenizer.decode)
        self._limits = _Limits(per_client=Tally())
        self.ready = False
        r = self.registry = CollectorRegistry()
        self.requests = Counter("prm_gateway_requests", "Requests answered", ["route", "code"], registry=r)
        self.latency = Histogram("prm_gateway_request_seconds", "Request latency (verdict wait included)", ["route"],
                                 registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                                                      60, 120, 300))
        self.in_flight = Gauge("prm_gateway_in_flight", "Requests being answered", registry=r)
        self.samples = Counter("prm_gateway_samples", "Samples scored, by verdict status", ["status"], registry=r)

    @property
    def authenticated(self) -> bool:
        return bool(self._tokens)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.gw.max_body_bytes, middlewares=[self._guard])
        app.add_routes([
            web.post("/openrlhf", self._openrlhf), web.post("/slime", self._slime), web.post("/v1/score", self._score),
            web.get("/healthz", self._healthz), web.get("/readyz", self._readyz), web.get("/metrics", self._metrics),
        ])
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
    async def _guard(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        route = request.path if request.path in ("/openrlhf", "/slime", "/v1/score") else "other"
        if request.path in ("/healthz", "/readyz"):
            return await handler(request)  # probes: no auth, no limits (they hold nothing)
        t0 = time.perf_counter()
        response = await self._guarded(request, handler, route)
        self.requests.labels(route, str(response.status)).inc()
        if route != "other":
            self.latency.labels(route).observe(time.perf_counter() - t0)
        return response

    async def _guarded(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                       route: str) -> web.StreamResponse:
        if self._tokens and not self._authorized(request.headers.get("Authorization", "")):
            return _error(401, "unauthorized", headers={"WWW-Authenticate": "Bearer"})
        if route == "other":
            return await handler(request)  # /metrics (authenticated when tokens are set) and 404s
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

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > self.gw.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.gw.max_body_bytes, actual_size=request.content_length)
        try:
            raw = await asyncio.wait_for(request.read(), self.gw.read_timeout_s)
        except TimeoutError:
            raise SlowBody(f"request body did not arrive within gateway.read_timeout_s={self.gw.read_timeout_s:g}s"
                             ) from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    # ------------------------------------------------------------------ scoring
    def _observe(self, reward: SampleReward) -> None:
        self.samples.labels(reward.status).inc()

    # ------------------------------------------------------------------ routes
    async def _openrlhf(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        queries = _list(body, "query", self.gw.max_items)
        prompts = _list(body, "prompts", self.gw.max_items)
        assert queries is not None and prompts is not None
        labels = body.get("labels")
        if labels is not None and (not isinstance(labels, list) or len(labels) != len(queries)):
            raise BadRequest("labels must be a list with one item per query")
        try:
            samples = samples_from_queries(queries, prompts, self.tokenizer)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        try:
            return web.json_response(await openrlhf_scores(self.client, self.gw, samples, prefix="gw",
                                                           observe=self._observe))
        except VerdictTimeout as exc:
            return _error(504, str(exc))

    async def _slime(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            prompt, messages = prompt_messages(body.get("prompt"), "prompt")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        response = body.get("response")
        if not isinstance(response, str):
            raise BadRequest("response must be a string")
        sample = Sample(prompt_ids=self.tokenizer.encode(prompt), response_ids=self.tokenizer.encode(response),
                        messages=messages)
        try:
            (answer,) = await slime_scores(self.client, self.gw, [sample], prefix="gw", observe=self._observe)
        except VerdictTimeout as exc:
            return _error(504, str(exc))
        return web.json_response(answer)

    async def _score(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        raw = _list(body, "samples", self.gw.max_items)
        assert raw is not None
        samples = []
        for i, s in enumerate(raw):
            if not isinstance(s, dict):
                raise BadRequest(f"samples[{i}] must be an object")
            unknown = set(s) - {"prompt_ids", "response_ids", "response_logprobs", "response_mask", "outcome_reward",
                                "messages", "truncated", "policy_version", "is_eval"}
            if unknown:
                raise BadRequest(f"samples[{i}]: unknown fields {sorted(unknown)}")
            prompt_ids = _ids(s.get("prompt_ids"), f"samples[{i}].prompt_ids")
            response_ids = _ids(s.get("response_ids"), f"samples[{i}].response_ids")
            n = len(response_ids)
            logprobs = s.get("response_logprobs")
            mask = s.get("response_mask")
            outcome = s.get("outcome_reward", 0.0)
            if not isinstance(outcome, (int, float)) or isinstance(outcome, bool) or not np.isfinite(outcome):
                raise BadRequest(f"samples[{i}].outcome_reward must be a finite number")
            messages = s.get("messages", [])
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise BadRequest(f"samples[{i}].messages must be a list of objects")
            version = s.get("policy_version")
            if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
                raise BadRequest(f"samples[{i}].policy_version must be an integer")
            samples.append(Sample(
                prompt_ids=prompt_ids, response_ids=response_ids,
                response_logprobs=None if logprobs is None else _floats(logprobs, f"samples[{i}].response_logprobs", n),
                response_mask=None if mask is None else [int(v) for v in _floats(mask, f"samples[{i}].response_mask", n)],
                outcome_reward=float(outcome), messages=messages, truncated=bool(s.get("truncated", False)),
                policy_version=version, is_eval=bool(s.get("is_eval", False)),
            ))
        (rewards,) = await score_groups(self.client, [samples], prefix="gw", observe=self._observe)
        try:
            check_late(rewards, AdapterSettings.from_gateway(self.gw))
        except VerdictTimeout as exc:
            return _error(504, str(exc))
        return web.json_response({
            "group_id": rewards[0].group_id, "status": rewards[0].status, "reason_code": rewards[0].reason_code,
            "reason": rewards[0].reason,
            "samples": [{"trajectory_id": r.trajectory_id, "status": r.status, "outcome": r.outcome,
                         "token_rewards": r.token_rewards.tolist(), "turn_rewards": r.turn_rewards}
                        for r in rewards],
        })

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503, text="ready\n" if self.ready else "starting\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _error(status: int, message: str, *, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


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
        raise ConfigError(f"gateway: listening on {gw.host} without authentication; set gateway.auth_tokens_env "
                          "or auth_tokens_file, or pass --allow-unauthenticated (behind a network policy)")
    log.warning("gateway listens on %s WITHOUT authentication (--allow-unauthenticated): anything that reaches "
                "this port can publish trajectories", gw.host)


async def serve(cfg: PipelineConfig, stop: asyncio.Event, *, allow_unauthenticated: bool = False,
                on_ready: Callable[[int], None] | None = None) -> None:
    """Run the gateway until ``stop`` is set."""
    gateway = Gateway(cfg)
    check_exposure(cfg.gateway, authenticated=gateway.authenticated, allow_unauthenticated=allow_unauthenticated)
    runner = web.AppRunner(gateway.app(), access_log=None)  # access logs would carry client addresses only
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.gateway.host, cfg.gateway.port, ssl_context=ssl_context(cfg.gateway))
        await site.start()
        port = runner.addresses[0][1]
        scheme = "https" if cfg.gateway.tls_certfile else "http"
        log.info("gateway listening on %s://%s:%d (tokenizer %s, auth %s)", scheme, cfg.gateway.host, port,
                 gateway.tokenizer.name, "on" if gateway.authenticated else "off")
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
    finally:
        await runner.cleanup()
