"""Parked turns of open streamed sessions against a real redis-server
(:mod:`scoring_workers.session_store`): idempotent per (session, turn), conflicts seen,
bounded, indexed by when a session goes idle, and readable by another worker."""

from __future__ import annotations

import uuid

import msgspec
import numpy as np
import pytest
import redis.asyncio as aioredis

from infra.config import RedisConfig
from infra.schema import stream_session
from infra.turns import TurnCompactor
from prm_pipeline.demo.synthetic import make_session
from scoring_workers.open_sessions import OpenSession
from scoring_workers.prm.streamed import StreamedResult
from scoring_workers.session_store import SessionStore, TurnOutcome

pytestmark = pytest.mark.integration


@pytest.fixture
async def store(redis_url: str):
    cfg = RedisConfig(url=redis_url, key_prefix=f"t{uuid.uuid4().hex[:8]}")
    client = aioredis.from_url(redis_url)
    yield SessionStore(client, cfg, idle_s=30.0, max_turns=5)
    await client.aclose()


def compact_turns(turns: int = 4):
    traj = make_session(
        trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=turns, rng=np.random.default_rng(0)
    )
    compactor = TurnCompactor()
    return [compactor.compact(t).interaction for t in stream_session(traj)[0]], traj


async def test_turns_park_once_and_come_back_in_order_for_another_worker(store: SessionStore, redis_url: str) -> None:
    turns, traj = compact_turns()
    for k, turn in enumerate(turns, 1):
        assert await store.park_turn("g", "t", turn, session_id="s", group_size=2) == (TurnOutcome.PARKED, k)
    assert await store.park_turn("g", "t", turns[1], session_id="s", group_size=2) == (TurnOutcome.DUPLICATE, 2)
    other = msgspec.structs.replace(turns[1], output_message_list=[{"role": "assistant", "content": "else"}])
    assert (await store.park_turn("g", "t", other, session_id="s", group_size=2))[0] is TurnOutcome.CONFLICT
    result = StreamedResult(scorer=0, name="j", interaction_id=turns[0].interaction_id, key=b"k", scalar=1.0)
    await store.park_results("g", "t", turns[0].interaction_id, turns[1].interaction_id, [result])
    # another worker's store (another client) reads the same session back
    client = aioredis.from_url(redis_url)
    try:
        parked = await SessionStore(
            client, RedisConfig(url=redis_url, key_prefix=store.prefix), idle_s=30.0, max_turns=5
        ).load("g", "t")
    finally:
        await client.aclose()
    assert parked.turns == turns
    assert parked.results == [result]
    assert parked.judged == {(turns[0].interaction_id, turns[1].interaction_id)}
    rebuilt = OpenSession.of("s", parked.turns)
    last = traj.interactions[-1]
    assert bytes(rebuilt.full(last.interaction_id).model_response.input_tokens_raw) == bytes(
        last.model_response.input_tokens_raw
    )


async def test_a_session_holds_at_most_max_turns(store: SessionStore) -> None:
    turns, _ = compact_turns(6)
    outcomes = [(await store.park_turn("g", "t", t, session_id="s", group_size=2))[0] for t in turns]
    assert outcomes == [TurnOutcome.PARKED] * 5 + [TurnOutcome.FULL]


async def test_idle_sessions_are_indexed_and_dropped_sessions_leave_the_index(store: SessionStore) -> None:
    turns, _ = compact_turns(2)
    await store.park_turn("g", "a", turns[0], session_id="sa", group_size=2)
    await store.park_turn("g", "b", turns[0], session_id="sb", group_size=2)
    assert await store.due() == []  # 30 s from now
    await store.postpone("g", "a", idle_s=31.0)  # as if 31 s passed
    assert await store.due() == [("g", "a")]
    idle, sid, size = await store.idle("g", "a")  # its hash says when it really was last seen
    assert 0.0 <= idle < 5.0 and (sid, size) == ("sa", 2)
    assert await store.redis.ttl(store.key("g", "a")) > 30
    await store.drop("g", "a")
    assert await store.due() == [] and await store.idle("g", "a") is None


async def test_the_first_turn_s_record_is_kept_for_reading_the_session_back(store: SessionStore) -> None:
    turns, _ = compact_turns(3)
    assert await store.first_record("g", "t") is None
    await store.park_turn("g", "t", turns[0], session_id="s", group_size=1, at=(1, 40))
    await store.park_turn("g", "t", turns[0], session_id="s", group_size=1, at=(1, 45))  # a later copy
    await store.park_turn("g", "t", turns[1], session_id="s", group_size=1, at=(1, 50))
    assert await store.first_record("g", "t") == (1, 40)
    assert (await store.load("g", "t")).at == (1, 40)
    await store.park_turn("g", "u", turns[0], session_id="s", group_size=1)  # parked without coordinates
    assert await store.first_record("g", "u") is None
