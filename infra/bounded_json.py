"""JSON from outside the process, decoded with a size and a nesting bound.

Untrusted JSON (a registry record, a gateway body, a JSONL line) must not be able to
do more than fail to decode. Two things let plain decoding do more: a document nested
deeper than the interpreter's recursion limit raises ``RecursionError`` from both
``json.loads`` and msgspec (neither is a ``ValueError``, so callers that catch decode
errors let it through, and a worker that meets it while starting exits), and a huge
document costs memory before anything can refuse it. :func:`decode_json` checks the
size first, then the nesting depth, then decodes with msgspec into the declared type,
and raises one error type, :class:`JSONBoundsError`, whatever went wrong.

The depth check counts brackets outside string literals with one compiled regular
expression (C speed per token); a document whose whole count of ``[`` and ``{`` is
within the bound skips it, which is the common case for small documents.
"""

from __future__ import annotations

import re
from typing import Any, Final, TypeVar

import msgspec

from infra.errors import WireError
from infra.types import validating

__all__ = ["DEFAULT_MAX_DEPTH", "JSONBoundsError", "decode_json", "json_depth"]

T = TypeVar("T")

DEFAULT_MAX_DEPTH: Final = 32
"""Deeper than any document we declare (a registry record nests 5 levels, a gateway body 4)."""

_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class JSONBoundsError(WireError, ValueError):
    """JSON from outside that is too large, too deep, malformed or not the declared type.

    A :class:`ValueError` too, so code written against ``json.loads`` keeps catching it.
    ``reason`` says which (``size``, ``depth``, ``syntax``, ``shape``) and ``detail`` is the
    decoder's own message (``shape``: msgspec's, ending with the path; ``syntax``: where).
    """

    def __init__(self, message: str, *, reason: str, detail: str = "") -> None:
        super().__init__(message)
        self.reason, self.detail = reason, detail


def json_depth(data: bytes, limit: int) -> int:
    """The nesting depth of ``data`` (brackets inside strings do not count); stops
    counting once ``limit`` is passed (returns ``limit + 1``)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return min(limit, data.count(b"[") + data.count(b"{"))
    depth = deepest = 0
    for match in _TOKENS.finditer(data):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def decode_json(
    data: bytes | bytearray | memoryview | str,
    type: type[T] = Any,  # type: ignore[assignment]
    *,
    what: str,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    strict: bool = True,
) -> T:
    """``data`` decoded as ``type``, or :class:`JSONBoundsError` naming ``what`` and the cause.

    ``strict=False`` lets strings stand for numbers and the like, as YAML-written
    documents expect (msgspec's lax mode).
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise JSONBoundsError(f"{what}: {len(raw)} bytes, over the limit of {max_bytes}", reason="size")
    if json_depth(raw, max_depth) > max_depth:
        raise JSONBoundsError(f"{what}: nested deeper than {max_depth} levels", reason="depth")
    try:
        with validating(
            root=type, error=lambda text: JSONBoundsError(f"{what}: {text}", reason="shape", detail=text.raw)
        ):
            return msgspec.json.decode(raw, type=type, strict=strict)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise JSONBoundsError(f"{what}: not valid JSON ({exc})", reason="syntax", detail=str(exc)) from None
