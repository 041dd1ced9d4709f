"""infra.logs: one log record is one line, whatever text it quotes; tracebacks keep their own lines."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest

from infra.logs import FORMAT, EscapingFormatter

FORGED = "2030-01-01 00:00:00,000 ERROR scoring_workers.worker: forged"
HOSTILE = f"g-1\n{FORGED}\r\x1b[31m\u2028\u202e"
RECORD_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def _logged(emit) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter(FORMAT))
    logger = logging.getLogger(f"test_logs.{id(stream)}")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def _records(text: str) -> list[str]:
    """The lines that start a record (a timestamp at the start of the line)."""
    return [line for line in text.splitlines() if RECORD_START.match(line)]


def _clean(text: str) -> None:
    assert not any(c in text for c in "\x1b\r\u2028\u202e"), text
    assert FORGED not in text.splitlines() and not any(line.startswith(FORGED) for line in text.splitlines())


def test_message_arguments_are_escaped_into_one_line() -> None:
    out = _logged(lambda log: log.warning("group=%s verdict=%s", HOSTILE, "accepted"))
    assert out.count("\n") == 1 and len(_records(out)) == 1
    _clean(out)
    assert f"group=g-1\\n{FORGED}\\r\\x1b[31m\\u2028\\u202e verdict=accepted" in out


def test_the_message_itself_is_escaped() -> None:
    out = _logged(lambda log: log.error(HOSTILE))
    assert out.count("\n") == 1
    _clean(out)


def test_an_exception_message_in_a_traceback_is_escaped_and_the_traceback_keeps_its_lines() -> None:
    def emit(log: logging.Logger) -> None:
        try:
            try:
                raise KeyError(HOSTILE)
            except KeyError as inner:
                err = ValueError(f"record kind {HOSTILE}")
                err.add_note(f"note {HOSTILE}")
                raise err from inner
        except ValueError:
            log.exception("decoding failed for %s", "g-2")

    out = _logged(emit)
    _clean(out)
    assert len(_records(out)) == 1  # the record's own line; nothing after it passes for another record
    lines = out.splitlines()
    assert lines[1] == "Traceback (most recent call last):" and any(line.startswith("  File ") for line in lines)
    assert f"ValueError: record kind g-1\\n{FORGED}" in out
    assert f"KeyError: 'g-1\\n{FORGED}" in out  # the cause, printed first in the chain
    assert "The above exception was the direct cause of the following exception:" in lines


def test_an_exception_group_member_cannot_start_a_line() -> None:
    def emit(log: logging.Logger) -> None:
        try:
            raise ExceptionGroup("several", [ValueError(HOSTILE), TypeError(HOSTILE)])
        except ExceptionGroup:
            log.exception("failed")

    out = _logged(emit)
    _clean(out)
    assert len(_records(out)) == 1


def test_a_cached_raw_traceback_of_another_handler_is_not_reused() -> None:
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    logging.Formatter().format(record)  # caches the raw text on the record
    out = EscapingFormatter(FORMAT).format(record)
    _clean(out)
    assert len(_records(out + "\n")) == 1


def test_stack_info_is_escaped_but_keeps_its_lines() -> None:
    out = _logged(lambda log: log.warning("here %s", "x", stack_info=True))
    assert "Stack (most recent call last):" in out.splitlines()


@pytest.mark.slow
def test_the_cli_logs_through_the_escaping_formatter() -> None:
    """Every process starts at prm_pipeline.cli.main: what it logs afterwards is escaped."""
    code = (
        "import logging, sys; from prm_pipeline.cli import main; "
        "code = main(['inspect', '--verdicts', '/nonexistent/verdicts.jsonl']); "  # refused before any connection
        f"logging.getLogger('scoring_workers.worker').warning('group=%s', {HOSTILE!r}); sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    _clean(proc.stderr)
    assert f"group=g-1\\n{FORGED}" in proc.stderr and len(_records(proc.stderr)) == 1
