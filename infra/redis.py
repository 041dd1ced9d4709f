"""The Redis client factory (the group ledger in scoring_workers is its only user).

``redis.url`` carries host, port, database and credentials (``redis://user:pass@host/0``
for ACL users, ``rediss://`` for TLS); ``redis.ssl_ca_certs`` adds a CA bundle.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from infra.config import RedisConfig


def make_redis(cfg: RedisConfig, **overrides: Any) -> aioredis.Redis:
    kwargs: dict[str, Any] = {"decode_responses": False, "health_check_interval": 30}
    if cfg.url.startswith("rediss://") and cfg.ssl_ca_certs:
        kwargs["ssl_ca_certs"] = cfg.ssl_ca_certs
    kwargs.update(overrides)
    return aioredis.from_url(cfg.url, **kwargs)
