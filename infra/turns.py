"""The compact wire form of a streamed session: each turn as a delta against its parent.

A ``ready`` record is compacted as a whole (:func:`infra.schema.compact_trajectory`):
every turn's parent is in the same record. A streamed session's turns travel one per
record, so the producer compacts a turn against the session's *earlier* turns — its
parent, which ``parent_id`` names (any earlier turn: sessions may branch). The
receiving worker expands it against the turns it parked
(:func:`infra.schema.streamed_trajectory`), so a streamed 1,000-turn session costs its
content on the wire, not the square of its turns.

What the producer remembers per turn is a digest of its context (its full messages +
output messages, its input + output tokens), not the context itself: memory per open
session is a few hundred bytes per turn however long the prompts grow. A turn shares
either its parent's whole context (the concat-export case: the digests of its prefix
match) or nothing (it travels in full): both are valid compact forms, and the worker
expands both to the turn the producer was given. Sessions are forgotten at their
``end``; at most ``max_sessions`` are remembered (least recently used first out), and a
turn whose session was forgotten travels in full — larger, never wrong.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from infra.schema import SessionEnd, SessionTurn

__all__ = ["TurnCompactor", "DEFAULT_MAX_SESSIONS"]

DEFAULT_MAX_SESSIONS = 10_000
"""Open sessions a producer remembers (about 100 bytes per turn each)."""

_ENCODER = msgspec.msgpack.Encoder(order="deterministic")


@dataclass(frozen=True, slots=True)
class _Context:
    """A turn's context as its children see it: how long it is, and its digest."""

    messages: int
    messages_digest: bytes
    token_bytes: int
    tokens_digest: bytes


def _digest(*parts: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def _messages_digest(messages: list[dict[str, Any]]) -> bytes:
    # Each message encoded on its own (keys sorted): a prefix of a list hashes like the
    # list it was cut from, whatever order the producer built the dicts in.
    return _digest(*(_ENCODER.encode(m) for m in messages))


class TurnCompactor:
    """Compacts the turns of streamed sessions against their parents (one producer's sessions)."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[tuple[str, str], dict[str, _Context]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def compact(self, turn: SessionTurn) -> SessionTurn:
        """``turn`` in the compact form (the same object when it shares nothing or already is compact)."""
        key = (turn.experiment, turn.trajectory_id)
        known = self._sessions.get(key)
        if known is None:
            known = self._sessions[key] = {}
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(key)
        it = turn.interaction
        if turn.is_compact:  # the caller compacted it: nothing to remember that we could check
            return turn
        mr = it.model_response
        in_raw = b"" if mr is None else memoryview(mr.input_tokens_raw).cast("B")
        out_raw = b"" if mr is None else memoryview(mr.output_tokens_raw).cast("B")
        full_messages = it.messages + it.output_message_list
        known[it.interaction_id] = _Context(
            len(full_messages), _messages_digest(full_messages), len(in_raw) + len(out_raw), _digest(in_raw, out_raw)
        )
        parent = known.get(it.parent_id) if it.parent_id is not None else None
        if parent is None:
            return turn
        shared_messages = (
            parent.messages
            if parent.messages
            and len(it.messages) >= parent.messages
            and _messages_digest(it.messages[: parent.messages]) == parent.messages_digest
            else 0
        )
        shared_bytes = (
            parent.token_bytes
            if mr is not None
            and parent.token_bytes
            and len(in_raw) >= parent.token_bytes
            and _digest(in_raw[: parent.token_bytes]) == parent.tokens_digest
            else 0
        )
        if not shared_messages and not shared_bytes:
            return turn
        if shared_bytes:
            assert mr is not None
            mr = msgspec.structs.replace(mr, input_tokens_raw=bytes(in_raw[shared_bytes:]))
        return msgspec.structs.replace(
            turn,
            interaction=msgspec.structs.replace(
                it,
                messages=it.messages[shared_messages:],
                shared_messages=shared_messages,
                model_response=mr,
                shared_tokens=shared_bytes // 4,
            ),
        )

    def end(self, end: SessionEnd) -> None:
        """Forget the session ``end`` closes (a later turn of it would travel in full)."""
        self._sessions.pop((end.experiment, end.trajectory_id), None)
