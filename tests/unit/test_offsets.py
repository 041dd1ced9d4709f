from aiokafka.structs import TopicPartition

from infra.offsets import OffsetTracker

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
