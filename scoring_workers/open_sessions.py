"""A streamed session while it is open, in a worker's memory: its turns, expandable one by one.

Turns arrive compact (:mod:`infra.turns`): each holds only what is new since its parent.
To score turn *t* when a child brings its next state, both need their full form — the
whole conversation and, for scorers that read them, the whole prompt. Expanding the
session's path for every arrival would cost the square of the session; instead
:class:`OpenSession` keeps, per turn, its conversation as a list and a length: a turn
that continues its parent's whole context appends to the parent's list, so a chain of
turns shares one growing list (of references to the message dicts), and only a branch
copies its head. It also keeps the *newest* turns' full token contexts (a chain's next
turn extends the newest one, so its prompt is one append away). A turn whose parent's
context was let go (a branch off an old turn) is rebuilt from the compact turns along
its path, once.

Memory per open session: the compact turns (the session's content), one reference per
message per chain (plus a copied head per branch), and :data:`CONTEXTS_KEPT` token
contexts, so linear in the session's length. Nothing here is durable:
the ledger holds the parked turns, and a worker that takes a session over rebuilds its
:class:`OpenSession` from them (:meth:`OpenSession.of`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import msgspec

from infra.schema import Interaction, InvalidMessage

__all__ = ["OpenSession", "CONTEXTS_KEPT"]

CONTEXTS_KEPT = 4
"""Token contexts (input + output of a turn) kept per session: the newest turns'."""


class OpenSession:
    """The turns of one streamed session received so far (arrival order), expandable."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.compact: dict[str, Interaction] = {}  # as received, in arrival order
        # full conversation of each turn: a list and its length; a chain's turns share one growing list
        self._messages: dict[str, tuple[list[Any], int]] = {}
        self._contexts: OrderedDict[str, bytes] = OrderedDict()  # newest turns' input + output tokens

    @classmethod
    def of(cls, session_id: str, turns: Iterable[Interaction]) -> OpenSession:
        """Rebuild a session from its parked turns (arrival order), e.g. after a takeover."""
        session = cls(session_id)
        for turn in turns:
            session.add(turn)
        return session

    def __len__(self) -> int:
        return len(self.compact)

    def __contains__(self, interaction_id: str) -> bool:
        return interaction_id in self.compact

    def add(self, turn: Interaction) -> Interaction:
        """Append ``turn`` (compact or full); return its full form.

        Raises :class:`InvalidMessage` when it is not the session's next turn: a repeated
        id, a parent that is not an earlier turn, or a delta sharing more than the
        parent's context holds.
        """
        iid = turn.interaction_id
        if iid in self.compact:
            raise InvalidMessage(f"session {self.session_id!r}: turn id {iid!r} is repeated")
        parent = turn.parent_id
        if parent is not None and parent not in self.compact:
            raise InvalidMessage(
                f"session {self.session_id!r}: turn {iid!r} names parent {parent!r}, which is "
                "not an earlier turn of the session"
            )
        messages, n = self._full_messages(turn)
        mr = turn.model_response
        if mr is not None and turn.shared_tokens:
            head = self._context(parent)  # type: ignore[arg-type]  # shared_tokens > 0 has a parent (schema)
            if turn.shared_tokens * 4 > len(head):
                raise InvalidMessage(
                    f"session {self.session_id!r}: turn {iid!r} shares {turn.shared_tokens} tokens "
                    f"with parent {parent!r}, whose context has only {len(head) // 4}"
                )
            mr = msgspec.structs.replace(mr, input_tokens_raw=head[: turn.shared_tokens * 4] + mr.input_tokens_raw)
        full = (
            turn
            if not (turn.shared_messages or turn.shared_tokens)
            else msgspec.structs.replace(
                turn, messages=messages[:n], model_response=mr, shared_messages=0, shared_tokens=0
            )
        )
        self.compact[iid] = turn
        self._messages[iid] = (messages, n)
        if mr is not None:
            self._keep(iid, bytes(mr.input_tokens_raw) + bytes(mr.output_tokens_raw))
        return full

    def full(self, interaction_id: str) -> Interaction:
        """The full form of a turn already added."""
        turn = self.compact[interaction_id]
        if not (turn.shared_messages or turn.shared_tokens):
            return turn
        mr = turn.model_response
        if mr is not None and turn.shared_tokens:
            head = self._context(turn.parent_id)  # type: ignore[arg-type]
            mr = msgspec.structs.replace(mr, input_tokens_raw=head[: turn.shared_tokens * 4] + mr.input_tokens_raw)
        messages, n = self._messages[interaction_id]
        return msgspec.structs.replace(
            turn, messages=messages[:n], model_response=mr, shared_messages=0, shared_tokens=0
        )

    def _full_messages(self, turn: Interaction) -> tuple[list[Any], int]:
        """The turn's conversation as (list, length): the first ``length`` items of the list.

        A turn that continues its parent's whole context, when nothing has grown the
        parent's list since, appends to that list: a chain holds one list, not one per turn.
        """
        if turn.parent_id is None or not turn.shared_messages:
            if turn.shared_messages:
                raise InvalidMessage(f"session {self.session_id!r}: root turn {turn.interaction_id!r} shares messages")
            return list(turn.messages), len(turn.messages)
        parent_list, pn = self._messages[turn.parent_id]
        parent_out = self.compact[turn.parent_id].output_message_list
        shared = turn.shared_messages
        if shared > pn + len(parent_out):
            raise InvalidMessage(
                f"session {self.session_id!r}: turn {turn.interaction_id!r} shares "
                f"{shared} messages with parent {turn.parent_id!r}, whose context "
                f"has only {pn + len(parent_out)}"
            )
        if shared == pn + len(parent_out) and len(parent_list) == pn:
            parent_list += parent_out
            parent_list += turn.messages
            return parent_list, len(parent_list)
        head = parent_list[: min(shared, pn)]
        if shared > pn:
            head += parent_out[: shared - pn]
        head += turn.messages
        return head, len(head)

    def _context(self, interaction_id: str) -> bytes:
        """The turn's input + output tokens (packed), rebuilt along its path when not kept."""
        kept = self._contexts.get(interaction_id)
        if kept is not None:
            self._contexts.move_to_end(interaction_id)
            return kept
        path: list[Interaction] = []
        node: str | None = interaction_id
        while node is not None and node not in self._contexts:
            path.append(self.compact[node])
            node = self.compact[node].parent_id
        ctx = b"" if node is None else self._contexts[node]
        for turn in reversed(path):
            mr = turn.model_response
            if mr is None:
                ctx = b""
                continue
            ctx = ctx[: turn.shared_tokens * 4] + bytes(mr.input_tokens_raw) + bytes(mr.output_tokens_raw)
        self._keep(interaction_id, ctx)
        return ctx

    def _keep(self, interaction_id: str, context: bytes) -> None:
        self._contexts[interaction_id] = context
        self._contexts.move_to_end(interaction_id)
        while len(self._contexts) > CONTEXTS_KEPT:
            self._contexts.popitem(last=False)
