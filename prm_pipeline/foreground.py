"""Run a foreground command (``up``, ``fake-judge``, ``model-server``) until SIGINT/SIGTERM.

Why not ``threading.Event`` set from the signal handler: CPython runs handlers in the
main thread between bytecodes, and ``Event.set()`` takes the non-reentrant lock that
``Event.wait()`` holds around its timed wait, so a signal landing in that window
deadlocks the process and the stop signal is lost. The handler here only appends the
signal number to a list (a single C call, no lock), and :meth:`StopSignals.wait` polls it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager: while inside, SIGINT/SIGTERM are recorded instead of killing us.

    Install it *before* starting what must be cleaned up, so a stop request during
    start-up still runs the ``finally`` blocks. The previous handlers come back on exit.
    Outside the main thread (where handlers cannot be installed) it records nothing and
    :meth:`wait` returns only when ``check`` says so.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[signal.Signals, Any] = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)

    def __enter__(self) -> StopSignals:
        try:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def wait(self, check: Callable[[], int | None] | None = None, poll_s: float = 0.1) -> int:
        """Block until a stop signal (returns 0) or until ``check()`` returns an exit code."""
        while not self.received:
            if check is not None and (code := check()) is not None:
                return code
            time.sleep(poll_s)
        return 0
