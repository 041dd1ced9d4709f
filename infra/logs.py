"""The log format of every ``prm-pipeline`` process (workers, gateway, shaper, one-shot
commands): one record is one line, whatever text it quotes.

Log messages quote what tenants send (group ids, a payload's ``kind``, registry keys,
error messages naming them). :class:`EscapingFormatter` passes the formatted message,
its arguments included, through :func:`infra.escape.printable`, so a newline in a group id
cannot forge a line and an ANSI escape never reaches the log raw. A traceback keeps its own
lines (they come from source files), but each exception's message and notes in it are
escaped like a message, and nothing else in it is left raw either.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from types import TracebackType

from infra.escape import printable

__all__ = ["FORMAT", "EscapingFormatter", "configure_logging"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


class EscapingFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose output holds no raw control, line-separator or bidi
    character outside a traceback's own line breaks (:mod:`infra.escape`)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info:
            record.exc_text = None  # ours, escaped, even where another handler cached a raw one
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return printable(super().formatMessage(record))

    def formatException(self, ei: _ExcInfo) -> str:  # noqa: N802 - logging's name
        text = super().formatException(ei)
        for exc in _chain(ei[1]):
            # "Type: message" (and its notes) as the traceback prints it: the part a tenant's text reaches
            raw = "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")
            if raw and raw != (shown := printable(raw)):
                text = text.replace(raw, shown)
        return printable(text, multiline=True)

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return printable(super().formatStack(stack_info), multiline=True)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions a traceback prints with it (causes, contexts, a group's members)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            todo += current.exceptions


def configure_logging(level: int) -> None:
    """Log to stderr at ``level`` through :class:`EscapingFormatter` (the root logger; as
    :func:`logging.basicConfig`, nothing changes where the root already has a handler)."""
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
