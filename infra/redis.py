"""The Redis client factory (the group ledger in scoring_workers is its only user).

``redis.url`` carries host, port, database and credentials (``redis://user:pass@host/0``
for ACL users, ``rediss://`` for TLS); ``redis.ssl_ca_certs`` adds a CA bundle;
``redis.cluster: true`` selects the Redis Cluster client.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from infra.config import RedisConfig


def make_redis(cfg: RedisConfig, **overrides: Any) -> aioredis.Redis | RedisCluster:
    """A standalone client, or a cluster client (``redis.cluster: true``) that follows slot redirects."""
    kwargs: dict[str, Any] = {"decode_responses": False}
    if cfg.url.startswith("rediss://") and cfg.ssl_ca_certs:
        kwargs["ssl_ca_certs"] = cfg.ssl_ca_certs
    kwargs.update(overrides)
    if cfg.cluster:
        return RedisCluster.from_url(cfg.url, **kwargs)
    return aioredis.from_url(cfg.url, health_check_interval=30, **kwargs)
