"""The shared deadline poll (tests/polling.py): returns the first truthy value, fails naming
what it waited for and what it saw last, and takes sync and async checks."""

from __future__ import annotations

import itertools

import pytest

from tests.polling import eventually, poll_until, wait_until


async def test_eventually_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert await eventually(lambda: max(0, next(counter) - 2), timeout_s=5, what="a count", interval_s=0) == 1


async def test_eventually_awaits_an_async_check() -> None:
    calls: list[int] = []

    async def check() -> list[int] | None:
        calls.append(1)
        return calls if len(calls) == 3 else None

    assert await eventually(check, timeout_s=5, what="three calls", interval_s=0) == [1, 1, 1]


async def test_eventually_names_what_and_the_last_value_on_timeout() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0.05s waiting for the moon \(last value: \[\]\)"):
        await eventually(lambda: [], timeout_s=0.05, what="the moon", interval_s=0.01)


async def test_a_callable_what_is_evaluated_only_on_failure() -> None:
    described: list[str] = []

    def what() -> str:
        described.append("asked")
        return "diagnostics"

    assert await eventually(lambda: 7, timeout_s=1, what=what) == 7
    assert described == []
    with pytest.raises(AssertionError, match="waiting for diagnostics"):
        await eventually(lambda: 0, timeout_s=0.02, what=what, interval_s=0.01)
    assert described == ["asked"]


class _Falsy:
    """Falsy with a long repr: a report object that says "not yet"."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "y" * 10_000


async def test_a_long_last_value_is_cut() -> None:
    with pytest.raises(AssertionError) as failed:
        await eventually(_Falsy, timeout_s=0.01, what="a short value")
    assert len(str(failed.value)) < 600 and str(failed.value).endswith("...)")


async def test_poll_until_reports_without_raising() -> None:
    held, waited, last = await poll_until(lambda: None, timeout_s=0.05, interval_s=0.01)
    assert (held, last) == (False, None) and waited >= 0.05
    polled = await poll_until(lambda: "yes", timeout_s=5)
    assert polled.held and polled.last == "yes" and polled.waited_s < 1


async def test_poll_until_awaits_between_instead_of_sleeping() -> None:
    ticks: list[int] = []

    async def between() -> None:
        ticks.append(1)

    polled = await poll_until(lambda: len(ticks) >= 4, timeout_s=5, between=between)
    assert polled.held and len(ticks) == 4


def test_wait_until_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 2 and "done", timeout_s=5, what="two calls", interval_s=0) == "done"


def test_wait_until_names_what_and_the_last_value_on_timeout() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the child \(last value: False\)"):
        wait_until(lambda: False, timeout_s=0.03, what="the child", interval_s=0.01)


async def test_accept_picks_the_value_waited_for_and_the_failure_shows_the_last_one() -> None:
    counter = itertools.count()
    assert await eventually(lambda: next(counter), accept=lambda n: n >= 3, timeout_s=5, what="3", interval_s=0) == 3
    with pytest.raises(AssertionError, match=r"waiting for an odd set \(last value: \{2\}\)"):
        await eventually(lambda: {2}, accept=lambda got: 1 in got, timeout_s=0.02, what="an odd set", interval_s=0.01)
    polled = await poll_until(lambda: 0, accept=lambda n: n == 0, timeout_s=1)
    assert polled.held and polled.last == 0  # a falsy value can be the one waited for
