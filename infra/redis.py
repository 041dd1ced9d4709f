"""The Redis client factory, and the shapes of its replies (the group ledger and the session
store in scoring_workers are its only users).

``redis.url`` carries host, port, database and credentials (``redis://user:pass@host/0``
for ACL users, ``rediss://`` for TLS); ``redis.ssl_ca_certs`` adds a CA bundle;
``redis.cluster: true`` selects the Redis Cluster client, and then ``redis.url`` may list
several nodes, comma-separated (``redis://user:pass@node-0:6379,redis://node-1:6379``):
the client starts from whichever answers, so a worker starts or restarts while one of
them is down (:func:`infra.config.redis_urls`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from infra.config import RedisConfig, redis_urls
from infra.errors import ServiceError

log = logging.getLogger(__name__)

RedisClient = aioredis.Redis | RedisCluster
"""What :func:`make_redis` returns: a standalone or a cluster client."""


def make_redis(cfg: RedisConfig, **overrides: Any) -> RedisClient:
    """A standalone client, or a cluster client (``redis.cluster: true``) that follows slot
    redirects and starts from any node ``redis.url`` lists (its ``startup_nodes``)."""
    first, *others = redis_urls(cfg)
    kwargs: dict[str, Any] = {"decode_responses": False}
    if first.scheme == "rediss" and cfg.ssl_ca_certs:
        kwargs["ssl_ca_certs"] = cfg.ssl_ca_certs
    kwargs.update(overrides)
    if cfg.cluster:
        if others:  # the first URL's credentials, TLS and options apply to every node
            kwargs["startup_nodes"] = [ClusterNode(u.hostname or "", u.port or 6379) for u in others]
        return RedisCluster.from_url(first.geturl(), **kwargs)
    return aioredis.from_url(first.geturl(), health_check_interval=30, **kwargs)


class RedisAccessError(ServiceError, RuntimeError):
    """Redis refused us for a reason no retry fixes (credentials, TLS trust); the message
    names the user and the setting, never the password."""


def _where(cfg: RedisConfig) -> str:
    urls = redis_urls(cfg)
    user = urls[0].username or "default"
    where = ", ".join(f"{u.hostname}:{u.port or 6379}" for u in urls)
    return f"Redis at {where} as user {user!r} (redis.url / PRM_REDIS_URL)"


def access_refusal(exc: BaseException, cfg: RedisConfig) -> RedisAccessError | None:
    """The :class:`RedisAccessError` for a refusal no retry fixes (login, ACL, TLS trust or
    handshake), or None when ``exc`` means only "not reachable (yet)"."""
    if isinstance(exc, AuthenticationError):
        return RedisAccessError(f"{_where(cfg)}: login refused: {exc}")
    if isinstance(exc, ResponseError) and any(w in str(exc) for w in ("NOPERM", "WRONGPASS", "no permissions")):
        # the ACL refuses a command (a script's included): grant it (docs/deploy.md), no retry helps
        return RedisAccessError(f"{_where(cfg)}: {exc}; grant the ledger's commands (docs/deploy.md)")
    if isinstance(exc, RedisConnectionError):
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            return RedisAccessError(
                f"{_where(cfg)}: its TLS certificate is not trusted; "
                f"redis.ssl_ca_certs is {cfg.ssl_ca_certs or 'unset (system trust store)'}"
            )
        if isinstance(cause, ssl.SSLError) or "SSL" in str(exc):
            return RedisAccessError(f"{_where(cfg)}: TLS handshake failed ({exc})")
    return None


async def verify_access(client: RedisClient, cfg: RedisConfig) -> None:
    """One ``PING`` at start-up, so wrong credentials or an untrusted certificate stop the
    process with one clear line instead of being retried forever as a connection error
    (redis-py's ``AuthenticationError`` is a ``ConnectionError``). A Redis that is merely
    down is left to the caller's retries."""
    try:
        await client.ping()
    except (AuthenticationError, ResponseError, RedisConnectionError) as exc:
        refused = access_refusal(exc, cfg)
        if refused is not None:
            raise refused from None
        log.warning("%s not reachable at start-up (%s); retrying as work arrives", _where(cfg), exc)


# --------------------------------------------------------------------------- replies
# Our clients never decode replies (``decode_responses=False``), so every reply is bytes; redis-py
# types them ``bytes | str`` because it cannot know the setting. These narrow a reply where it
# is decoded, one helper per shape, and refuse a reply of another shape (a client made elsewhere).
class RedisReplyError(ServiceError, TypeError):
    """A Redis reply is not of the shape its command gives our clients: the client decodes
    replies (it was not made by :func:`make_redis`)."""


def reply_bytes(reply: object) -> bytes:
    """A string reply (or one field or value of a hash) as the bytes Redis sent."""
    if isinstance(reply, bytes):
        return reply
    raise RedisReplyError(f"Redis replied {type(reply).__name__}, not bytes: use a client made by make_redis")


def reply_text(reply: object) -> str:
    """A string reply that holds UTF-8 text (an id, a status)."""
    return reply_bytes(reply).decode()


def reply_hash(reply: Mapping[bytes | str, bytes | str]) -> dict[bytes, bytes]:
    """A hash as ``HGETALL`` returns it: field -> value."""
    return {reply_bytes(name): reply_bytes(value) for name, value in reply.items()}


def reply_members(reply: Iterable[object]) -> list[bytes]:
    """A sorted set's members, as a range read without scores returns them."""
    return [reply_bytes(member) for member in reply]


def reply_scored(reply: Iterable[object]) -> list[tuple[bytes, float]]:
    """A sorted set's ``(member, score)`` pairs, as a range read ``withscores`` returns them."""
    out: list[tuple[bytes, float]] = []
    for entry in reply:
        match entry:
            case (bytes() as member, float() | int() as score):
                out.append((member, float(score)))
            case _:
                raise RedisReplyError(
                    f"Redis replied {type(entry).__name__} for a scored member: use a client made by make_redis"
                )
    return out
