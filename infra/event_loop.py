"""The event loop the long-running commands run on: uvloop where it is installed.

Why: a worker's CPU is mostly the event loop and the Python clients' per-request work, not
scoring (docs/capacity.md, "Where a worker's CPU goes"). On the same load, uvloop (libuv
under asyncio's API) measured 7–22 % less CPU per trajectory near peak and 8 % less while
idle (a worker process: 4.7 instead of 5.0–5.1 % of a core) than asyncio's own loop,
with the same clients and code. The commands that stay up —
``worker``, ``trainer``, ``gateway`` — run on it; short commands keep ``asyncio.run``.

:class:`LoopThread` is the other way onto a loop: synchronous code (a trainer's hook, a
worker thread) hands coroutines to one loop running on a daemon thread, where the
asyncio clients live. It is the project's one such bridge; :class:`LoopClient` adds the
client made on it on first use.

``PRM_EVENT_LOOP=asyncio`` forces asyncio's loop (to debug with its debug mode, or where
uvloop is not installed: it has no Windows build); ``uvloop`` requires it. Unset or
``auto`` takes uvloop when importable.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from infra.config import ConfigError

__all__ = ["ENV", "LoopClient", "LoopThread", "loop_factory", "loop_name", "run"]

ENV = "PRM_EVENT_LOOP"
_CHOICES = ("auto", "uvloop", "asyncio")

T = TypeVar("T")
C = TypeVar("C")


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


class LoopThread:
    """An asyncio event loop on a daemon thread, for synchronous callers of asyncio clients.

    Clients created by coroutines run here belong to this loop (aiokafka's clients are
    bound to the loop that made them), so every later call must come through
    :meth:`run` too. Calling :meth:`run` from this loop itself would block the loop that
    must answer: that is an error, not a deadlock.
    """

    def __init__(self, name: str = "prm-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the thread's loop and wait (at most ``timeout`` seconds) for its result."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError(f"{self.thread.name}: called from its own event loop; await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and its thread (what still runs on it is abandoned)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class LoopClient(Generic[C]):
    """The sync bridge with its client: a :class:`LoopThread` and the client ``make()`` builds on it.

    Both start on the first :meth:`run`, from any thread; a client that cannot start
    (Kafka unreachable) leaves no thread behind and the next call tries again.
    :meth:`close` closes the client (``aclose()``) and stops the thread; a later
    :meth:`run` starts both anew.
    """

    def __init__(self, make: Callable[[], Awaitable[C]], name: str, *, start_timeout: float | None = None) -> None:
        self._make, self._name, self._start_timeout = make, name, start_timeout
        self._lock = threading.Lock()
        self._bridge: LoopThread | None = None
        self._client: C | None = None

    async def _made(self) -> C:
        return await self._make()

    def client(self) -> tuple[LoopThread, C]:
        """The bridge and its client, started if they were not."""
        with self._lock:
            if self._bridge is None:
                bridge = LoopThread(self._name)
                try:
                    self._client = bridge.run(self._made(), self._start_timeout)
                except BaseException:
                    bridge.close()
                    raise
                self._bridge = bridge
            assert self._client is not None
            return self._bridge, self._client

    def run(self, use: Callable[[C], Coroutine[Any, Any, T]], timeout: float | None = None) -> T:
        """``use(client)`` run on the bridge's loop; waits for its result."""
        bridge, client = self.client()
        return bridge.run(use(client), timeout)

    def close(self, timeout: float | None = 30) -> None:
        with self._lock:
            bridge, client, self._bridge, self._client = self._bridge, self._client, None, None
        if bridge is not None:
            try:
                bridge.run(client.aclose(), timeout)  # type: ignore[union-attr]
            finally:
                bridge.close()
