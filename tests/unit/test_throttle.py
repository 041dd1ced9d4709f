"""Rate-limited log lines (infra.throttle) on a fake clock."""

from __future__ import annotations

import logging

from infra.throttle import Every, LogThrottle


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_log_throttle_writes_a_burst_per_window_then_counts_what_it_held(caplog) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    throttle = LogThrottle(logging.getLogger("t"), burst=3, window_s=10, clock=clock)
    written = [throttle.log(logging.INFO, "dup %s", i) for i in range(5)]
    assert written == [True, True, True, False, False]
    assert [r.getMessage() for r in caplog.records][:2] == ["dup 0", "dup 1"]
    assert "at most 3 per 10s" in caplog.records[2].getMessage()
    clock.t = 10.5
    assert throttle.log(logging.INFO, "dup %s", 5)
    assert "2 more lines like the next held back" in caplog.records[3].getMessage()
    assert caplog.records[4].getMessage() == "dup 5"


def test_every_gates_a_periodic_line() -> None:
    clock = Clock()
    every = Every(30, first_s=5, clock=clock)
    assert not every.due()
    clock.t = 5
    assert every.due() and not every.due()
    clock.t = 34.9
    assert not every.due()
    clock.t = 35
    assert every.due()
    every.reset(first_s=5)
    assert not every.due()
