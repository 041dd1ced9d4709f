"""The grammar of every id on the wire, declared once for every struct that carries one.

Ids (group, session, trajectory, interaction, scorer) come from producers and are
untrusted. They are keys: Redis keys, Kafka record keys, dedupe keys, log fields. An
id that holds a control character could forge a log line or a terminal escape; one
that holds :data:`infra.experiments.SCOPE_SEPARATOR` could name a group of another
experiment in a scoped key; an unbounded one costs memory everywhere it is kept. So
every wire struct types its ids as :data:`WireId` (experiment ids as the stricter
:data:`ExperimentId`), and msgspec refuses a record that breaks the grammar while it
decodes it (``InvalidMessage``: the worker dead-letters it) — no id is checked by
hand after decoding.

The grammar: 1 to :data:`MAX_ID_LENGTH` characters, none of them a control character
(C0, which holds the scope separator, DEL and C1), a line or paragraph separator, or a
zero-width / bidirectional formatting character. Spaces and other printable Unicode
stay allowed: producers name groups as they like. The pattern is anchored with ``\\Z``
(msgspec searches, and ``$`` would accept a trailing newline).

Cost: msgspec runs one regex search per id, 0.3-0.5 µs whatever the pattern (the call,
not the scan): about 10 µs more to decode a 16-turn trajectory, no change beyond the
run-to-run spread in a worker's CPU per trajectory (``bench capacity``). A parent id is
not checked again: the tree check makes it one of the trajectory's interaction ids.
"""

from __future__ import annotations

import re
from typing import Annotated, Final

import msgspec

from infra.experiments import EXPERIMENT_ID_PATTERN

__all__ = ["ExperimentId", "ID_PATTERN", "MAX_ID_LENGTH", "WireId", "is_wire_id"]

MAX_ID_LENGTH: Final = 256
"""At most this many characters (a UUID is 36; a group id built from a prompt hash and a step is far below)."""

_FORBIDDEN: Final = (  # regex escapes, not the characters: the pattern shows in msgspec's errors, so in logs
    r"\x00-\x1f\x7f-\x9f"  # C0 (\n, \r, ESC, the scope separator \x1f), DEL, C1 (NEL, CSI)
    r"\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"  # zero-width, bidi marks, line/paragraph separators
    r"\ud800-\udfff"  # lone surrogates
)
ID_PATTERN: Final = re.compile(f"^[^{_FORBIDDEN}]+\\Z")

WireId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=ID_PATTERN.pattern,
        description=f"an id: 1 to {MAX_ID_LENGTH} printable characters, no control or formatting characters",
    ),
]
"""A group, session, trajectory, interaction or scorer id on the wire."""

ExperimentId = Annotated[
    str,
    msgspec.Meta(
        pattern=f"^(?:{EXPERIMENT_ID_PATTERN.pattern})\\Z",
        description="an experiment id: letters, digits, '.', '_', '-'; at most 64 characters",
    ),
]
"""An experiment id on the wire (:data:`infra.experiments.EXPERIMENT_ID_PATTERN`)."""


def is_wire_id(text: str) -> bool:
    """True when ``text`` follows the :data:`WireId` grammar (for ids that arrive outside a
    struct, such as a record's key)."""
    return len(text) <= MAX_ID_LENGTH and ID_PATTERN.search(text) is not None
