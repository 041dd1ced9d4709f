"""The event loop the long-running commands run on: uvloop where it is installed.

Why: a worker's CPU is mostly the event loop and the Python clients' per-request work, not
scoring (docs/capacity.md, "Where a worker's CPU goes"). On the same load, uvloop (libuv
under asyncio's API) measured 7–22 % less CPU per trajectory near peak and 8 % less while
idle (a worker process: 4.7 instead of 5.0–5.1 % of a core) than asyncio's own loop,
with the same clients and code. The commands that stay up —
``worker``, ``trainer``, ``gateway`` — run on it; short commands keep ``asyncio.run``.

``PRM_EVENT_LOOP=asyncio`` forces asyncio's loop (to debug with its debug mode, or where
uvloop is not installed: it has no Windows build); ``uvloop`` requires it. Unset or
``auto`` takes uvloop when importable.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from infra.config import ConfigError

__all__ = ["ENV", "loop_factory", "loop_name", "run"]

ENV = "PRM_EVENT_LOOP"
_CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")


def _choice() -> str:
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(_CHOICES)}")
    return value


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None for asyncio's default loop (see the module rules)."""
    choice = _choice()
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(f"{ENV}=uvloop but uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what :func:`run` will use (for the start-up log line)."""
    return "asyncio" if loop_factory() is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    try:
        factory = loop_factory()
    except BaseException:
        main.close()  # never awaited: do not leave a "coroutine was never awaited" warning behind
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
