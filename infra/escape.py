"""Untrusted text, shown: the one way record, registry and request text reaches a log line,
a terminal or a verdict reason.

Ids, payload fields, registry keys and error messages quoting them come from tenants. Shown
raw, a newline forges a whole log line (``2030-01-01 00:00:00,000 ERROR ...``), an ANSI
escape recolours or rewrites the operator's terminal, and a bidi override makes a line read
differently from what it holds. :func:`printable` writes every such character as a visible
escape (``\\n``, ``\\x1b``, ``\\u202e``) and leaves everything else, other Unicode included,
as it is: a log line stays one line, and the text can still be read and searched.

Escaped: C0 controls and DEL, C1 controls (``\\x9b`` is a one-byte CSI to some terminals),
the Unicode line and paragraph separators (``\\u2028``, ``\\u2029``: line breaks to many
log viewers) and the bidi controls (embeddings, overrides, isolates and marks). A backslash
is left alone: it cannot start a line or an escape sequence, and doubling it would mangle
every path and pattern an operator greps for.

rich renders markup (``[bold]``, ``[link=...]``) in the strings it is handed; untrusted text
goes to rich only inside a :class:`rich.text.Text`, which renders none (:func:`rich_text`).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.text import Text

__all__ = ["json_line", "printable", "rich_text"]

_OTHER_UNSAFE = "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[\x00-\x1f{_OTHER_UNSAFE}]")
_UNSAFE_BUT_LINES = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER_UNSAFE}]")  # keeps \t and \n
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, multiline: bool = False) -> str:
    """``text`` with every control, line-separator and bidi character written as an escape.

    ``multiline`` keeps newlines and tabs (a prompt or model output shown as a block, a
    traceback's own lines); everything else is escaped as without it.
    """
    if not multiline and text.isprintable():  # the common case, and the fastest test: every escaped
        return text  # character is a control, format or separator character, none of which is printable
    pattern = _UNSAFE_BUT_LINES if multiline else _UNSAFE
    if pattern.search(text) is None:  # nothing to do, no copy
        return text
    return pattern.sub(_escaped, text)


def json_line(value: Any) -> str:
    """``value`` as one JSON line for a terminal: non-ASCII text stays readable (``ensure_ascii``
    off), and the characters :func:`printable` escapes are ``\\uXXXX`` escapes (the json module
    escapes only C0 controls; it passes C1, separators and bidi controls raw)."""
    text = json.dumps(value, ensure_ascii=False)
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def rich_text(text: str, style: str = "", *, multiline: bool = False) -> Text:
    """Untrusted ``text`` for rich: escaped by :func:`printable`, and in a ``Text``, so that
    rich renders no markup in it."""
    from rich.text import Text

    return Text(printable(text, multiline=multiline), style=style)
