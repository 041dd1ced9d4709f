"""``redis.url`` with several Redis Cluster nodes: checked at load, every node a startup node of the client."""

from __future__ import annotations

import pytest

from infra.config import ConfigError, PipelineConfig, RedisConfig, config_from_mapping, validate
from infra.redis import (
    RedisReplyError,
    _where,
    make_redis,
    reply_hash,
    reply_members,
    reply_scored,
    reply_text,
)
from infra.startup import redis_address

TWO = "redis://prm:s3cret@node-0:7000/0,redis://node-1:7001"


def test_several_urls_need_cluster_mode_and_agree_on_scheme_and_credentials() -> None:
    with pytest.raises(ConfigError, match="several nodes are for Redis Cluster"):
        validate(PipelineConfig(redis=RedisConfig(url=TWO)))
    validate(PipelineConfig(redis=RedisConfig(url=TWO, cluster=True)))
    for bad, why in [
        ("redis://a:1,rediss://b:2", "must be redis://host:port"),
        ("redis://u:p@a:1,redis://v:q@b:2", "other credentials"),
        ("redis://a:1,,redis://b:2", "empty entry"),
    ]:
        with pytest.raises(ConfigError, match=why):
            validate(PipelineConfig(redis=RedisConfig(url=bad, cluster=True)))
    # the environment override takes the same list
    cfg = config_from_mapping({}, environ={"PRM_REDIS_URL": TWO, "PRM_REDIS_CLUSTER": "true"})
    assert cfg.redis.url == TWO


async def test_the_cluster_client_starts_from_every_listed_node_with_the_first_urls_login() -> None:
    client = make_redis(RedisConfig(url=TWO, cluster=True))
    try:
        nodes = {(n.host, n.port): n for n in client.startup_nodes}
        assert set(nodes) == {("node-0", 7000), ("node-1", 7001)}
        for node in nodes.values():
            assert (node.connection_kwargs["username"], node.connection_kwargs["password"]) == ("prm", "s3cret")
    finally:
        await client.aclose()


def test_messages_name_every_node_and_no_password() -> None:
    cfg = RedisConfig(url=TWO, cluster=True)
    assert redis_address(cfg) == "redis://node-0:7000/0,redis://node-1:7001"
    assert _where(cfg).startswith("Redis at node-0:7000, node-1:7001 as user 'prm'")
    assert "s3cret" not in repr(cfg) and "s3cret" not in _where(cfg)


def test_replies_are_read_as_our_clients_get_them_and_another_shape_is_refused() -> None:
    """Our clients never decode replies: bytes pass, text (a decoding client) is refused by name."""
    assert reply_text(b"decided") == "decided"
    assert reply_hash({b"m:t1": b"\x93", b"n": b"1"}) == {b"m:t1": b"\x93", b"n": b"1"}
    assert reply_members([b"a", b"b"]) == [b"a", b"b"]
    assert reply_scored([(b"w-1", 17.0), [b"w-2", 3]]) == [(b"w-1", 17.0), (b"w-2", 3.0)]
    for bad in (lambda: reply_text("decided"), lambda: reply_hash({"n": "1"}), lambda: reply_members(["a"])):
        with pytest.raises(RedisReplyError, match="not bytes: use a client made by make_redis"):
            bad()
    for entry in ("w-1", ("w-1", 1.0), (b"w-1",), (b"w-1", "1")):
        with pytest.raises(RedisReplyError, match="for a scored member"):
            reply_scored([entry])
