"""Progress on a terminal for long commands (``publish``, ``bench``): rich bars with
records/s, bytes and ETA, or a spinner with the elapsed time.

Shown only when stdout is a terminal and ``--quiet`` is not given: piped or redirected
output stays exactly what it was (scripts parse it). ``audit`` draws its own bars on
stderr (:mod:`prm_pipeline.audit.report`; ``--quiet``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_enabled(quiet: bool, stream: IO[str] | None = None) -> bool:
    """Whether to draw progress: not ``--quiet`` and ``stream`` (stdout) is a terminal."""
    stream = stream if stream is not None else sys.stdout
    return not quiet and stream.isatty()


def _rate(task: object) -> str:
    speed = getattr(task, "speed", None)
    return "" if speed is None else f"{speed:,.0f} records/s"


@contextlib.contextmanager
def publish_progress(
    path: str | os.PathLike[str], *, enabled: bool, console: Console | None = None
) -> Iterator[Callable[[str, int], None]]:
    """``on_progress(phase, n)`` for :meth:`producers.publisher.TrajectoryPublisher.publish_jsonl`:
    one bar while lines are validated (the file's size is known), one while records are sent."""
    size = os.path.getsize(path)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
    validate = progress.add_task(f"validating {os.fspath(path)} ({size / 1e6:,.1f} MB)", total=None, rate="")
    publish = progress.add_task("publishing", total=None, rate="", start=False)

    def on_progress(phase: str, n: int) -> None:
        if phase == "validated":
            progress.advance(validate, n)
            progress.update(validate, rate=_rate(progress.tasks[validate]))
        elif phase == "publishing":  # n = records about to be sent
            progress.update(validate, total=progress.tasks[validate].completed)
            progress.update(publish, total=n)
            progress.start_task(publish)
        else:
            progress.advance(publish, n)
            progress.update(publish, rate=_rate(progress.tasks[publish]))

    with progress:
        yield on_progress


@contextlib.contextmanager
def spinner(description: str, *, enabled: bool, console: Console | None = None) -> Iterator[None]:
    """A spinner with the elapsed time while a command whose length is unknown runs; its
    own prints go through (rich redirects stdout above the spinner)."""
    with Progress(
        SpinnerColumn(),
        TextColumn(description),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
        transient=True,
        redirect_stdout=True,
        redirect_stderr=True,
    ) as progress:
        progress.add_task(description, total=None)
        yield
