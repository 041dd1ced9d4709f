"""Running a coroutine's first step by hand, so that work which never waits costs no task.

Most scorers (``LengthBudgetScorer``, rule-based ones) finish without suspending. Driving
their coroutine with ``coro.send(None)`` finishes them in the caller's task; only one that
does suspend costs anything more. The runner scores a branch's turns this way and the
worker a poll's members (:mod:`scoring_workers.worker`).
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any


class Resume:
    """Await a coroutine whose first step was already run by hand.

    A coroutine that did suspend is finished *in the same task* through this object,
    which forwards every later send/throw exactly as ``await`` would (PEP 380), so
    ``asyncio.timeout()``, contextvars and cancellation inside the coroutine see one
    consistent task.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._first
        self._first = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded, not handled
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value
