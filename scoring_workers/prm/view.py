"""Branch-local, read-only views of interactions: what a scorer receives.

:class:`infra.schema.Interaction` is a frozen wire struct without a ``parent`` link,
and one interaction can sit on several root-to-leaf branches. The runner therefore
builds one :class:`InteractionView` per (branch, turn): ``parent`` points at the
previous view *of the same branch*, so a scorer walking up the chain never leaves its
branch, and rewards it produces stay branch-local (AReaL's Process Rewards, "Branches").

The view keeps AReaL's attribute names (``interaction_id``, ``parent``, ``parent_id``,
``messages``, ``output_message_list``, ``reward``, ``model_response``, ``token_rewards``) so AReaL scorers
port unchanged. ``model_response`` is the wire object itself: its token arrays are
read-only numpy views over immutable bytes, so sharing it costs nothing and cannot be
corrupted. ``messages`` / ``output_message_list`` are frozen lazily, on first access,
and shared by every branch of one run: cheap scorers that only look at tokens never pay
for freezing, and the frozen copies are immutable so sharing them is safe. A message
object that several turns share (an expanded compact trajectory gives every turn the
same dicts for its common history) is frozen once per run, so a long session costs
its messages, not the square of its turns.
"""

from __future__ import annotations

import itertools
import operator
from typing import TYPE_CHECKING, Any, NoReturn

from scoring_workers.prm._frozen import freeze

if TYPE_CHECKING:
    import numpy as np

    from infra.schema import Interaction, ModelResponse

__all__ = ["InteractionView", "MessageCache"]

MessageCache = dict[str, tuple[Any, Any]]
"""Per-run cache: interaction id -> (frozen messages, frozen output_message_list); the
entry under ``""`` (never an interaction id) maps ``id(message)`` to (message, frozen message)."""

_SHARED = ""


def _freeze_each(messages: Any, memo: dict[int, tuple[Any, Any]]) -> tuple[Any, ...]:
    out = []
    for m in messages:
        hit = memo.get(id(m))
        if hit is None or hit[0] is not m:
            hit = memo[id(m)] = (m, freeze(m))
        out.append(hit[1])
    return tuple(out)


class InteractionView:
    """One turn as a scorer sees it (read-only; attribute assignment raises)."""

    __slots__ = (
        "interaction_id",
        "parent",
        "parent_id",
        "reward",
        "model_response",
        "token_rewards",
        "_source",
        "_cache",
    )

    interaction_id: str
    parent: InteractionView | None
    parent_id: str | None
    reward: float | None
    model_response: ModelResponse
    token_rewards: np.ndarray | None
    """Pre-existing token rewards (read-only float32 view), or None; scorer
    contributions are added to them."""
    _source: Any
    _cache: dict[Any, Any]

    def __init__(self, source: Interaction, parent: InteractionView | None, cache: MessageCache) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "interaction_id", source.interaction_id)
        setattr_(self, "parent", parent)
        setattr_(self, "parent_id", source.parent_id)
        setattr_(self, "reward", source.reward)
        setattr_(self, "model_response", source.model_response)
        setattr_(self, "token_rewards", getattr(source, "token_rewards", None))
        setattr_(self, "_source", source)
        setattr_(self, "_cache", cache)

    def _frozen(self) -> tuple[Any, Any]:
        entry = self._cache.get(self.interaction_id)
        if entry is None:
            memo = self._cache.setdefault(_SHARED, ({}, None))[0]
            messages, head = self._source.messages, ()
            # A turn whose conversation starts with its parent's whole context (the same
            # message objects: an expanded compact session) reuses the parent's frozen
            # tuples: a long session's views cost C-level copies, not a Python loop per
            # message per turn.
            parent = self.parent
            done = None if parent is None else self._cache.get(parent.interaction_id)
            if parent is not None and done is not None:
                before, said = parent._source.messages, parent._source.output_message_list
                n = len(before) + len(said)
                if (
                    n
                    and len(messages) >= n
                    and all(map(operator.is_, messages, before))  # ``map`` stops at the shorter
                    and all(map(operator.is_, itertools.islice(messages, len(before), n), said))
                ):
                    head, messages = done[0] + done[1], messages[n:]
            entry = (head + _freeze_each(messages, memo), _freeze_each(self._source.output_message_list, memo))
            self._cache[self.interaction_id] = entry
        return entry

    @property
    def messages(self) -> tuple[dict[str, Any], ...]:
        """The turn's input conversation, as a tuple of read-only dicts."""
        return self._frozen()[0]

    @property
    def output_message_list(self) -> tuple[dict[str, Any], ...]:
        """The turn's generated messages, as a tuple of read-only dicts."""
        return self._frozen()[1]

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"interaction views are read-only (cannot set {name!r})")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"interaction views are read-only (cannot delete {name!r})")

    def __repr__(self) -> str:
        response = self.model_response
        n = response.output_len if response is not None else None
        return f"InteractionView(interaction_id={self.interaction_id!r}, parent_id={self.parent_id!r}, output_len={n})"
