"""Slots shared by weight, capped by quota, handed on when unused; idle experiments keep a way in."""

from __future__ import annotations

from scoring_workers.fair_share import slot_caps


def test_a_lone_busy_experiment_uses_the_worker_but_leaves_idle_ones_a_slot() -> None:
    caps = slot_caps(32, {"a": 1, "b": 1}, {"a": 32})
    assert caps == {"a": 31, "b": 1}
    assert slot_caps(32, {"a": 1}, {"a": 5}) == {"a": 32}


def test_busy_experiments_share_by_weight() -> None:
    assert slot_caps(32, {"a": 1, "b": 1}, {"a": 31, "b": 1}) == {"a": 16, "b": 16}
    assert slot_caps(40, {"a": 3, "b": 1}, {"a": 40, "b": 2}) == {"a": 30, "b": 10}


def test_a_quota_caps_an_experiment_and_its_unused_share_goes_to_the_others() -> None:
    caps = slot_caps(32, {"a": 1, "b": 1, "c": 1}, {"a": 9, "b": 9, "c": 9}, {"a": 2})
    assert caps["a"] == 2 and caps["b"] == caps["c"] == 15
    assert slot_caps(32, {"a": 1}, {"a": 1}, {"a": 4}) == {"a": 4}


def test_more_experiments_than_slots_still_gives_each_busy_one_a_slot() -> None:
    caps = slot_caps(2, {e: 1 for e in "abcd"}, {e: 1 for e in "abcd"})
    assert all(c >= 1 for c in caps.values())


def test_idle_experiments_share_one_reserved_slot_however_many_they_are() -> None:
    weights = {"a": 1, "b": 2, "c": 5, "d": 1}
    caps = slot_caps(64, weights, {"a": 10, "b": 3})
    assert caps["c"] == caps["d"] == 1
    assert caps["a"] + caps["b"] == 64 - 1
    assert caps["b"] >= 2 * caps["a"] - 1
    twenty = slot_caps(32, {f"e{i}": 1 for i in range(20)}, {"e0": 40})
    assert twenty["e0"] == 31 and all(twenty[f"e{i}"] == 1 for i in range(1, 20))
