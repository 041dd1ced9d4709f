"""Polls with a deadline: the one way tests wait for something to become true.

A test never sleeps to let something happen; it asks "has it happened yet?" every
``interval_s`` until a deadline, and fails saying what it waited for and what it saw last.
:func:`eventually` (async, the check may be sync or async) and :func:`wait_until` (sync, for
tests that drive child processes) raise ``AssertionError`` at the deadline; :func:`poll_until`
reports instead, for tests whose assertion is about *whether* or *how fast* something held.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, NamedTuple, TypeVar, overload

T = TypeVar("T")

INTERVAL_S = 0.05  # short enough not to add latency to a test, long enough not to spin
_REPR_MAX = 400  # the last value goes into the failure message, cut to stay readable

What = str | Callable[[], object]  # a description, or a callable giving one at failure time (diagnostics)


class Polled(NamedTuple, Generic[T]):
    """The result of :func:`poll_until`: whether the check held, after how long, and its last value."""

    held: bool
    waited_s: float
    last: T


@overload
async def poll_until(check: Callable[[], Awaitable[T]], *, timeout_s: float, interval_s: float = INTERVAL_S,
                     between: Callable[[], Awaitable[object]] | None = None) -> Polled[T]: ...
@overload
async def poll_until(check: Callable[[], T], *, timeout_s: float, interval_s: float = INTERVAL_S,
                     between: Callable[[], Awaitable[object]] | None = None) -> Polled[T]: ...
async def poll_until(check: Callable[[], Any], *, timeout_s: float, interval_s: float = INTERVAL_S,
                     between: Callable[[], Awaitable[object]] | None = None) -> Polled[Any]:
    """Call ``check`` (sync or async) until it returns something truthy or ``timeout_s`` passed.

    Between checks it awaits ``between()`` when given (e.g. a consumer's ``getmany`` that must
    keep running), else sleeps ``interval_s``. The check runs once more after the deadline has
    passed, so a condition that holds at the deadline counts. Never raises on timeout.
    """
    t0 = time.monotonic()
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        waited = time.monotonic() - t0
        if last:
            return Polled(True, waited, last)
        if waited > timeout_s:
            return Polled(False, waited, last)
        if between is not None:
            await between()
        else:
            await asyncio.sleep(interval_s)


@overload
async def eventually(check: Callable[[], Awaitable[T]], *, timeout_s: float, what: What,
                     interval_s: float = INTERVAL_S, between: Callable[[], Awaitable[object]] | None = None) -> T: ...
@overload
async def eventually(check: Callable[[], T], *, timeout_s: float, what: What,
                     interval_s: float = INTERVAL_S, between: Callable[[], Awaitable[object]] | None = None) -> T: ...
async def eventually(check: Callable[[], Any], *, timeout_s: float, what: What, interval_s: float = INTERVAL_S,
                     between: Callable[[], Awaitable[object]] | None = None) -> Any:
    """The first truthy result of ``check`` (sync or async); ``AssertionError`` naming ``what``
    and the last value if none came within ``timeout_s``."""
    held, waited, last = await poll_until(check, timeout_s=timeout_s, interval_s=interval_s, between=between)
    if not held:
        raise AssertionError(_timed_out(timeout_s, what, last))
    return last


def wait_until(check: Callable[[], T], *, timeout_s: float, what: What, interval_s: float = INTERVAL_S) -> T:
    """:func:`eventually` for synchronous tests (child processes, files): blocks between checks."""
    t0 = time.monotonic()
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(_timed_out(timeout_s, what, last))
        time.sleep(interval_s)


def _timed_out(timeout_s: float, what: What, last: object) -> str:
    described = what() if callable(what) else what
    shown = repr(last)
    if len(shown) > _REPR_MAX:
        shown = shown[:_REPR_MAX] + "..."
    return f"timed out after {timeout_s:g}s waiting for {described} (last value: {shown})"
