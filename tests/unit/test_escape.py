"""infra.escape: untrusted text shown as one escaped line (terminal, JSON line, rich)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from infra.escape import json_line, printable, rich_text

HOSTILE = "g-1\n2030-01-01 00:00:00,000 ERROR forged\r\x1b[31mred\x1b[0m\x9b2J\u2028next\u202eevil\x00\x7f"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("line\nbreak", "line\\nbreak"),
        ("carriage\rreturn", "carriage\\rreturn"),
        ("tab\there", "tab\\there"),
        ("\x1b[2J", "\\x1b[2J"),
        ("nul\x00del\x7f", "nul\\x00del\\x7f"),
        ("c1 csi\x9b", "c1 csi\\x9b"),
        ("next\x85line", "next\\x85line"),
        ("sep\u2028para\u2029", "sep\\u2028para\\u2029"),
        ("bidi\u202eoverride\u2066isolate\u2069\u200f\u061c", "bidi\\u202eoverride\\u2066isolate\\u2069\\u200f\\u061c"),
    ],
)
def test_every_control_separator_and_bidi_character_is_written_as_an_escape(raw: str, shown: str) -> None:
    assert printable(raw) == shown


def test_ordinary_text_is_returned_as_it_is() -> None:
    text = "grüße 世界 \\n [bold]x[/bold] émoji 🙂 C:\\path"
    assert printable(text) is text  # no copy in the common case
    other = "no-break\u00a0space, zero\u200dwidth joiner"  # not printable to str.isprintable, nothing to escape
    assert printable(other) is other


def test_hostile_text_becomes_one_line_without_escape_bytes() -> None:
    shown = printable(HOSTILE)
    assert shown.splitlines() == [shown]
    assert not any(c in shown for c in "\x1b\x9b\r\x00\u2028\u202e")
    assert "\\n2030-01-01 00:00:00,000 ERROR forged" in shown


def test_multiline_keeps_newlines_and_tabs_only() -> None:
    assert printable("a\n\tb\r\x1b[1mc", multiline=True) == "a\n\tb\\r\\x1b[1mc"


def test_json_line_escapes_what_json_passes_raw_and_round_trips() -> None:
    value = {"group_id": HOSTILE, "note": "grüße"}
    line = json_line(value)
    assert line.splitlines() == [line] and "grüße" in line
    assert not any(c in line for c in "\x1b\x9b\x85\u2028\u202e\x7f")
    assert json.loads(line) == value


def test_rich_text_renders_no_markup_and_no_escapes() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=400)
    console.print(rich_text("[bold red]fake[/bold red] [link=http://evil]x[/link]\x1b[31m"))
    assert out.getvalue().rstrip("\n") == "[bold red]fake[/bold red] [link=http://evil]x[/link]\\x1b[31m"
