from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import TopicPartition

from infra.offsets import OffsetCommitter, OffsetTracker

TP = TopicPartition("t", 0)
TP1 = TopicPartition("t", 1)


def test_commits_only_up_to_the_lowest_unfinished_offset() -> None:
    t = OffsetTracker()
    for o in (5, 6, 7):
        t.begin(TP, o)
    t.finish(TP, 7)
    t.finish(TP, 6)
    assert t.committable() == {TP: 5}  # 5 still scoring: nothing past it is safe
    t.finish(TP, 5)
    assert t.committable() == {TP: 8}


def test_nothing_to_commit_twice() -> None:
    t = OffsetTracker()
    t.begin(TP, 0)
    t.finish(TP, 0)
    offsets = t.committable()
    assert offsets == {TP: 1}
    t.mark_committed(offsets)
    assert t.committable() == {}


def test_partitions_are_independent_and_dropped_on_revoke() -> None:
    t = OffsetTracker()
    t.begin(TP, 10)
    t.begin(TP1, 3)
    t.finish(TP1, 3)
    assert t.committable() == {TP: 10, TP1: 4}
    assert t.in_flight() == 1 and t.in_flight({TP1}) == 0
    t.drop({TP})
    t.finish(TP, 10)  # a late finish of a revoked partition is ignored
    assert t.committable() == {TP1: 4}


class _Consumer:
    """The slice of aiokafka's consumer that OffsetCommitter uses, with a rebalance we control."""

    def __init__(self, assigned: set[TopicPartition], highs: dict[TopicPartition, int]) -> None:
        self.assigned, self.highs = set(assigned), highs
        self.commits: list[dict[TopicPartition, int]] = []
        self.revoke_during_committed: TopicPartition | None = None

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def highwater(self, tp: TopicPartition) -> int | None:
        assert tp in self.assigned, "Partition is not assigned"  # as aiokafka does
        return self.highs.get(tp)

    async def committed(self, tp: TopicPartition) -> int | None:
        if self.revoke_during_committed is not None:  # the rebalance lands at this await
            self.assigned.discard(self.revoke_during_committed)
        return 0

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if any(tp not in self.assigned for tp in offsets):
            raise IllegalStateError("Partition is not assigned")
        self.commits.append(dict(offsets))


A, B = TopicPartition("t", 0), TopicPartition("t", 1)


async def test_committer_commits_only_partitions_still_assigned_and_forgets_the_rest() -> None:
    consumer = _Consumer({A}, {})
    committer = OffsetCommitter(consumer, owner="test")  # type: ignore[arg-type]
    committer.tracker.begin(A, 4)
    committer.tracker.begin(B, 9)  # B was revoked while its record was in flight
    committer.tracker.finish(A, 4)
    committer.tracker.finish(B, 9)
    await committer.commit()
    assert consumer.commits == [{A: 5}]  # one revoked partition must not fail the whole commit
    assert committer.tracker.committable() == {}


async def test_committer_reports_a_refused_commit_and_does_not_raise() -> None:
    consumer = _Consumer({A}, {})
    failures: list[BaseException] = []
    committer = OffsetCommitter(consumer, owner="test", on_failure=failures.append)  # type: ignore[arg-type]

    async def refuse(offsets: dict[TopicPartition, int]) -> None:
        raise CommitFailedError("rebalanced")

    consumer.commit = refuse  # type: ignore[method-assign]
    committer.tracker.begin(A, 0)
    committer.tracker.finish(A, 0)
    await committer.commit()
    assert [type(e) for e in failures] == [CommitFailedError]
    assert committer.tracker.committable() == {A: 1}  # still owed: the next commit tries again


async def test_lag_survives_a_rebalance_at_any_await() -> None:
    consumer = _Consumer({A, B}, {A: 10, B: 7})
    committer = OffsetCommitter(consumer, owner="test")  # type: ignore[arg-type]
    consumer.revoke_during_committed = B
    lag = await committer.lag()
    assert B not in lag and lag[A] == 10
    consumer.assigned = {A}  # revoked between two lag steps: never asked about again
    assert await committer.lag() == {A: 10}


async def test_routine_commits_wait_for_the_interval_but_revocation_does_not() -> None:
    consumer = _Consumer({A}, {})
    committer = OffsetCommitter(consumer, owner="test", min_interval_s=3600)  # type: ignore[arg-type]
    committer.tracker.begin(A, 0)
    committer.tracker.finish(A, 0)
    assert committer.due
    await committer.commit(routine=True)  # the first one goes out
    assert consumer.commits == [{A: 1}] and not committer.due
    committer.tracker.begin(A, 1)
    committer.tracker.finish(A, 1)
    await committer.commit(routine=True)  # within the interval: one request fewer
    assert consumer.commits == [{A: 1}]
    await committer.revoke({A})  # a rebalance never waits
    assert consumer.commits == [{A: 1}, {A: 2}]


async def test_without_an_interval_every_routine_commit_goes_out() -> None:
    consumer = _Consumer({A}, {})
    committer = OffsetCommitter(consumer, owner="test")  # type: ignore[arg-type]
    for offset in (0, 1):
        committer.tracker.begin(A, offset)
        committer.tracker.finish(A, offset)
        await committer.commit(routine=True)
    assert consumer.commits == [{A: 1}, {A: 2}]
