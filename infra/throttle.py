"""Rate-limited log lines: say that something happened without flooding the log.

Quiet success is hard to trust (a duplicate publish that is silently deduplicated looks
like a lost one), but a line per event drowns everything else under load. A
:class:`LogThrottle` writes the first ``burst`` lines of each window and then one line
saying how many it held back; :class:`Every` gates a periodic progress line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["Every", "LogThrottle"]


class LogThrottle:
    """At most ``burst`` lines per ``window_s`` through :meth:`log`; the lines held back are
    counted and reported with the first line of the next window."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._emitted = 0
        self._held = 0

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless this window's budget is spent; True when written."""
        now = self._clock()
        if now - self._window_start >= self.window_s:
            if self._held:
                self.logger.log(
                    level,
                    "(%d more lines like the next held back in the last %.0fs)",
                    self._held,
                    now - self._window_start,
                )
            self._window_start, self._emitted, self._held = now, 0, 0
        if self._emitted < self.burst:
            self._emitted += 1
            if self._emitted == self.burst:
                msg += " (further lines like this: at most %d per %.0fs)"
                args = (*args, self.burst, self.window_s)
            self.logger.log(level, msg, *args)
            return True
        self._held += 1
        return False


class Every:
    """True from :meth:`due` at most once per ``interval_s`` (the first call after ``first_s``)."""

    def __init__(self, interval_s: float, *, first_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = clock() + first_s

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def reset(self, first_s: float = 0.0) -> None:
        """Start over: the next line comes ``first_s`` from now."""
        self._next = self._clock() + first_s
