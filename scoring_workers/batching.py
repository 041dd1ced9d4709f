"""Batching for the ledger: items submitted by concurrent tasks go out together.

Generic and Redis-free: :class:`Batcher` gathers items while a call is on the wire and
hands the next call all of them; an item may *linger* (wait a bounded time for company)
so that work which is not urgent rides along with work that is. The ledger
(:mod:`scoring_workers.ledger`) uses it for its script calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _wake_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Batcher(Generic[T, R]):
    """Gathers items submitted by concurrent tasks into batches: while one batch is on the
    wire, new items queue; the next batch takes them all (one call, one round trip).

    An item may *linger*: it waits up to that long for company (the next item that does
    not linger, or the end of its wait, sends every item pending), so that work which is
    not urgent rides along with work that is instead of costing a round trip of its own.
    """

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]]) -> None:
        self._run = run
        self._pending: list[tuple[T, asyncio.Future[R], float]] = []
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None  # set while every pending item lingers
        self._wake_at = 0.0  # when the lingering drain wakes up by itself

    async def submit(self, item: T, *, linger_s: float = 0.0) -> R:
        (result,) = await self.submit_many([item], linger_s=linger_s)
        return result

    async def submit_many(self, items: Sequence[T], *, linger_s: float = 0.0) -> list[R]:
        """Several items at once: they go in the same batch."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[R]] = [loop.create_future() for _ in items]
        due = loop.time() + linger_s
        self._pending += ((item, fut, due) for item, fut in zip(items, futs))
        if self._wake is not None and (linger_s <= 0 or due < self._wake_at):
            _wake_up(self._wake)  # send now, or wait less: an item that lingers less than the others came
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return list(await asyncio.gather(*futs))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            wait = min(due for _, _, due in self._pending) - loop.time()
            if wait > 0:  # every pending item lingers: until the first is due, or urgent work comes
                self._wake = wake = loop.create_future()
                self._wake_at = loop.time() + wait
                timer = loop.call_later(wait, _wake_up, wake)
                try:
                    await wake
                finally:
                    timer.cancel()
                    self._wake = None
                if min(due for _, _, due in self._pending) > loop.time():
                    continue  # woken by an item due sooner than the others, not yet due: wait for it
            batch, self._pending = self._pending, []
            try:
                results = await self._run([item for item, _, _ in batch])
            except BaseException as exc:  # every submitter sees the failure (and retries)
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(exc if isinstance(exc, Exception) else ConnectionError(repr(exc)))
                if not isinstance(exc, Exception):
                    raise
                continue
            for (_, fut, _), result in zip(batch, results):
                if not fut.done():
                    fut.set_result(result)

    @property
    def lingering(self) -> bool:
        """Whether every pending item is waiting for company (the drain sleeps until one is due)."""
        return self._wake is not None

    def hurry(self) -> None:
        """Send what lingers now (at shutdown: nothing must wait for company that will not come)."""
        now = asyncio.get_running_loop().time()
        self._pending = [(item, fut, min(due, now)) for item, fut, due in self._pending]
        if self._wake is not None:
            _wake_up(self._wake)

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        pending, self._pending = self._pending, []
        for _, fut, _ in pending:  # never sent: their submitters must not wait forever
            if not fut.done():
                fut.set_exception(ConnectionError("the ledger was closed"))
