"""The CLI's flag vocabulary: one meaning per flag name, times in seconds everywhere.

:data:`VOCABULARY` is the table of the flags that more than one command takes or that
name a time (README, "Flags"); ``tests/unit/test_cli_vocabulary.py`` walks every
command's parser and checks that a flag name keeps one destination and one type
across commands and that the shared ones are listed here. Argument types
(:func:`positive_int`, :func:`seconds`, :func:`port`) live here once, and so does
:func:`deprecated_alias`, which keeps an old spelling working, hidden from ``--help``,
with a one-line warning on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from infra.ports import MAX_PORT

__all__ = ["DEPRECATED", "VOCABULARY", "deprecated_alias", "port", "positive_int", "seconds"]

# flag -> its one meaning (README "Flags" restates this table; a test compares them).
VOCABULARY: dict[str, str] = {
    "--config FILE": "YAML config file (before or after the command; default `$PRM_CONFIG`)",
    "-v, --verbose": "debug logging",
    "-q, --quiet": "no progress bar or spinner (none either when the output is not a terminal)",
    "--experiment ID": "work on this experiment's topics (default `trainer.experiment`; "
    "`status`, `dead-letters`: no filter)",
    "--since TIME": "only records timestamped at/after TIME: ISO-8601 or an age (`15m`, `2h`, `1d`)",
    "--out PATH": "write the output there instead of stdout (`demo`: the report folder)",
    "--group ID": "only this group",
    "--json": "one JSON object per line, for machines",
    "--concurrency N": "work items in flight at once",
    "--metrics-port P": "serve Prometheus `/metrics` on port P",
    "--host ADDR, --port P": "listen address and port (port 0: any free port)",
    "--idle-timeout S": "stop after S seconds without a new record (`verdicts`, `trainer`)",
    "--wait S": "seconds to wait for a result before giving up (`inspect --group`)",
    "--read-timeout S": "bound of each read, in seconds (`status`)",
    "--scorer-timeout S": "bound of each re-scoring, in seconds (`audit`; default `worker.scorer_timeout_s`)",
    "--watch S": "repeat every S seconds until interrupted (`status`)",
    "--sample S": "seconds between the two lag readings of one report (`status`)",
    "--verdict-lookback S": "verdict rate and latency over the last S seconds (`status`)",
    "--dead-letter-lookback S": "dead letters of the last S seconds (`status`)",
    "--latency S": "delay before every answer, in seconds (`fake-judge`)",
}

# old spelling -> (command, new spelling): kept working, hidden, with a one-line warning.
DEPRECATED: dict[tuple[str, str], str] = {
    ("verdicts", "--timeout"): "--idle-timeout",
    ("audit", "--timeout"): "--scorer-timeout",
    ("audit", "--no-progress"): "--quiet",
    ("inspect", "--timeout"): "--wait",
    ("status", "--timeout"): "--read-timeout",
    ("status", "--verdict-window"): "--verdict-lookback",
    ("status", "--dead-letter-window"): "--dead-letter-lookback",
    ("fake-judge", "--latency-ms"): "--latency",
}


def positive_int(text: str) -> int:
    """argparse type for counts that must be >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def seconds(text: str) -> float:
    """argparse type for a duration in seconds: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {text!r}")
    return value


def port(text: str) -> int:
    """argparse type for a listening port: 0 (any free port) to 65535, the bound of
    :data:`infra.ports.Port` (a larger number would wrap modulo 65536 at the socket)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"expected a port from 0 (any free port) to {MAX_PORT}, got {text!r}")
    return value


class _DeprecatedAlias(argparse.Action):
    """An old spelling: sets the new flag's destination (converted) and warns once on stderr."""

    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        *,
        new: str,
        note: str = "",
        convert: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new, self.note, self.convert = new, note, convert

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"warning: {option_string} is deprecated, use {self.new}{self.note}", file=sys.stderr)
        value = self.const if self.nargs == 0 else values
        setattr(namespace, self.dest, self.convert(value) if self.convert is not None else value)


def deprecated_alias(
    p: argparse.ArgumentParser,
    old: str,
    new: argparse.Action,
    *,
    note: str = "",
    convert: Callable[[Any], Any] | None = None,
    type: Callable[[str], Any] | None = None,
) -> None:
    """Keep ``old`` working as a hidden spelling of the flag ``new`` (the action
    ``add_argument`` returned). A flag without a value passes ``const``; one with a value
    reads it with ``type`` (default: ``new``'s) and stores ``convert(value)``."""
    flag = next(s for s in new.option_strings if s.startswith("--"))
    if new.nargs != 0 and new.metavar:
        flag = f"{flag} {new.metavar}"
    kwargs: dict[str, Any] = (
        {"nargs": 0, "const": new.const} if new.nargs == 0 else {"type": type or new.type, "metavar": new.metavar}
    )
    p.add_argument(
        old,
        action=_DeprecatedAlias,
        dest=new.dest,
        new=flag,
        note=note,
        convert=convert,
        default=argparse.SUPPRESS,
        **kwargs,
    )
