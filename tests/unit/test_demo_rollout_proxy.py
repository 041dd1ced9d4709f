"""The demo's rollout proxy streams: each turn goes out as it is sampled, then the session's end,
and the streamed sessions are the ones the ready form samples from the same seed."""

from __future__ import annotations

from typing import Any

import msgspec

from infra.schema import SessionEnd, SessionTurn, TrajectoryMessage, streamed_trajectory
from prm_pipeline.demo.rollout_proxy import RolloutConfig, RolloutProxy
from tests import real_model
from tests.real_model import one_torch_thread  # noqa: F401 - autouse fixture


class _Recorder:
    """Stands in for :class:`~producers.publisher.TrajectoryPublisher`'s streamed-session calls:
    records each message with the number of turns the proxy had sampled when it was sent."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.sent: list[tuple[TrajectoryMessage, int]] = []
        self.flushes = 0

    async def publish_turn(self, turn: SessionTurn) -> None:
        self.sent.append((turn, self.proxy.stats.turns))

    async def end_session(self, end: SessionEnd) -> None:
        self.sent.append((end, self.proxy.stats.turns))

    async def flush(self) -> None:
        self.flushes += 1


async def test_a_streamed_group_is_the_ready_group_of_the_same_seed() -> None:
    ready, streamed = (RolloutProxy(real_model.policy(), RolloutConfig(group_size=3, seed=3)) for _ in range(2))
    want = ready.group("g-stream")
    pub = _Recorder(streamed)
    got = await streamed.stream_group(pub, "g-stream")  # type: ignore[arg-type]
    assert got == [msgspec.structs.replace(w, created_at=g.created_at) for w, g in zip(want, got)]
    assert any(len({i.parent_id for i in m.interactions}) < len(m.interactions) for m in got)  # one branches
    for member in got:
        records = [m for m, _ in pub.sent if m.session_id == member.session_id]
        turns, end = records[:-1], records[-1]
        assert all(isinstance(t, SessionTurn) for t in turns) and isinstance(end, SessionEnd)
        assert (end.outcome_reward, end.policy_version, end.turn_count) == (
            member.outcome_reward,
            member.policy_version,
            len(member.interactions),
        )
        assert streamed_trajectory([t.interaction for t in turns], end).interactions == member.interactions
        assert member.session_id in streamed.stats.ended
    assert pub.flushes == len(got)  # each end is flushed (acknowledged) before its time is noted


async def test_each_turn_goes_out_before_the_next_one_is_sampled() -> None:
    proxy = real_model.proxy(seed=4)
    pub = _Recorder(proxy)
    await proxy.stream_group(pub, "g-live")  # type: ignore[arg-type]
    sampled_before = [n for m, n in pub.sent if isinstance(m, SessionTurn)]
    assert sampled_before == list(range(1, proxy.stats.turns + 1))  # turn k is sent once k turns exist, no later
    ends = [n for m, n in pub.sent if isinstance(m, SessionEnd)]
    assert len(ends) == proxy.config.group_size


async def test_sessions_held_whole_go_out_streamed_too() -> None:
    proxy = real_model.proxy(seed=5)
    members = proxy.group("g-whole")
    pub = _Recorder(proxy)
    pub.publish_many = _publish_many(pub)  # type: ignore[attr-defined]
    sent = await proxy.publish(pub, members)  # type: ignore[arg-type]
    assert sent == sum(len(m.interactions) + 1 for m in members)
    kinds = [type(m).__name__ for m, _ in pub.sent]
    assert "ReadyTrajectory" not in kinds and kinds.count("SessionEnd") == len(members)
    assert pub.flushes == 1


def _publish_many(pub: _Recorder) -> Any:
    async def publish_many(messages: list[TrajectoryMessage]) -> int:
        for m in messages:
            await (pub.end_session(m) if isinstance(m, SessionEnd) else pub.publish_turn(m))  # type: ignore[arg-type]
        return len(messages)

    return publish_many
