"""Which fetched records need a ledger probe: those a previous owner of the partition may have read."""

from __future__ import annotations

from aiokafka.structs import TopicPartition

from scoring_workers.probe_marks import ProbeMarks

A, B = TopicPartition("t", 0), TopicPartition("t", 1)


def test_no_mark_yet_means_probe() -> None:
    marks = ProbeMarks()
    assert marks.needs_probe(A, 0) and marks.needs_probe(A, 10**9)


def test_records_below_the_first_highwater_are_probed_later_ones_are_not() -> None:
    marks = ProbeMarks()
    marks.learn([A, B], {A: 5, B: None}.get)
    assert marks.needs_probe(A, 4)  # a previous owner may have read it
    assert not marks.needs_probe(A, 5) and not marks.needs_probe(A, 6)  # published after the assignment
    assert marks.needs_probe(B, 100)  # no fetch answered for B yet


def test_the_first_mark_stays_while_the_highwater_grows() -> None:
    marks = ProbeMarks()
    marks.learn([A], {A: 5}.get)
    marks.learn([A], {A: 50}.get)
    assert marks.mark(A) == 5 and not marks.needs_probe(A, 20)


def test_forgotten_on_revoke_and_learnt_again() -> None:
    marks = ProbeMarks()
    marks.learn([A, B], {A: 5, B: 7}.get)
    marks.forget([A])
    assert marks.needs_probe(A, 6) and not marks.needs_probe(B, 7)
    marks.learn([A], {A: 9}.get)
    assert marks.needs_probe(A, 8) and not marks.needs_probe(A, 9)
    marks.forget([A, B])
    assert marks.mark(A) is None and marks.mark(B) is None
