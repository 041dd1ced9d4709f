"""Polls with a deadline: the one way tests wait for something to become true.

A test never sleeps to let something happen; it asks "has it happened yet?" every
``interval_s`` until a deadline, and fails saying what it waited for and what it saw last.
:func:`eventually` (async, the check may be sync or async) and :func:`wait_until` (sync, for
tests that drive child processes) raise ``AssertionError`` at the deadline; :func:`poll_until`
reports instead, for tests whose assertion is about *whether* or *how fast* something held.
A check returns the value it read; ``accept`` says which value is the one waited for, so the
failure message shows what was read last.
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


Between = Callable[[], Awaitable[object]]  # awaited between checks instead of sleeping
Accept = Callable[[Any], object]  # whether a checked value is the one waited for (default: truthy)


@overload
async def poll_until(
    check: Callable[[], Awaitable[T]],
    *,
    timeout_s: float,
    interval_s: float = INTERVAL_S,
    accept: Accept | None = None,
    between: Between | None = None,
) -> Polled[T]: ...
@overload
async def poll_until(
    check: Callable[[], T],
    *,
    timeout_s: float,
    interval_s: float = INTERVAL_S,
    accept: Accept | None = None,
    between: Between | None = None,
) -> Polled[T]: ...
async def poll_until(
    check: Callable[[], Any],
    *,
    timeout_s: float,
    interval_s: float = INTERVAL_S,
    accept: Accept | None = None,
    between: Between | None = None,
) -> Polled[Any]:
    """Call ``check`` (sync or async) until its value is accepted (``accept(value)``, by default
    the value's truth) or ``timeout_s`` passed; never raises on timeout.

    Between checks it awaits ``between()`` when given (e.g. reading a consumer that must keep
    being read), else sleeps ``interval_s``. The check runs once more after the deadline has
    passed, so a condition that holds at the deadline counts.
    """
    t0 = time.monotonic()
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        waited = time.monotonic() - t0
        if accept(last) if accept is not None else last:
            return Polled(True, waited, last)
        if waited > timeout_s:
            return Polled(False, waited, last)
        if between is not None:
            await between()
        else:
            await asyncio.sleep(interval_s)


@overload
async def eventually(
    check: Callable[[], Awaitable[T]],
    *,
    timeout_s: float,
    what: What,
    interval_s: float = INTERVAL_S,
    accept: Accept | None = None,
    between: Between | None = None,
) -> T: ...
@overload
async def eventually(
    check: Callable[[], T],
    *,
    timeout_s: float,
    what: What,
    interval_s: float = INTERVAL_S,
    accept: Accept | None = None,
    between: Between | None = None,
) -> T: ...
async def eventually(
    check: Callable[[], Any],
    *,
    timeout_s: float,
    what: What,
    interval_s: float = INTERVAL_S,
    accept: Accept | None = None,
    between: Between | None = None,
) -> Any:
    """The first accepted value of ``check`` (see :func:`poll_until`); ``AssertionError`` naming
    ``what`` and the last value if none came within ``timeout_s``."""
    held, _, last = await poll_until(check, timeout_s=timeout_s, interval_s=interval_s, accept=accept, between=between)
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
