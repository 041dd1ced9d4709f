"""The long-running commands' event loop: uvloop unless told otherwise, a clear error for a bad choice."""

from __future__ import annotations

import asyncio

import pytest

from infra import event_loop
from infra.config import ConfigError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.run(_loop_module()).startswith("uvloop")
    assert event_loop.loop_name() == "uvloop"


def test_asyncio_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.run(_loop_module()).startswith("asyncio")
    assert event_loop.loop_name() == "asyncio"


def test_unknown_choice_is_one_line_error_and_closes_the_coroutine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "tokio")
    coro = _loop_module()
    with pytest.raises(ConfigError, match=r"PRM_EVENT_LOOP='tokio': expected one of auto, uvloop, asyncio"):
        event_loop.run(coro)
    assert coro.cr_frame is None  # closed, not left pending


def test_uvloop_required_but_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setenv(event_loop.ENV, "uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        event_loop.loop_factory()
    monkeypatch.setenv(event_loop.ENV, "auto")
    assert event_loop.loop_factory() is None
