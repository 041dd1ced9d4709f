"""Prefix-shared turns: the one expansion behind every compact form of a session.

A turn of an agent session repeats its parent's context: its prompt is (usually) the
parent's prompt + the parent's output + something new (a tool result, a user turn), and
its conversation is the parent's messages + the parent's output messages + the new ones.
Storing every turn in full makes a session grow with the square of its turns; the
compact forms store, per turn, how many leading items it shares with its parent's
context and only the items that follow. Two compact forms exist — the trajectories
topic's compact ``ready`` records (``shared_tokens`` / ``shared_messages``, any prefix
length) and the verdict's ``TokenTurn`` (always the parent's whole context) — and both
are expanded here, so workers, the audit and the trainer agree on every sequence.

Token prompts come back as read-only ``memoryview`` slices over one buffer per chain of
turns: in a chain, turn k's prompt is a prefix of turn k+1's, so a 100-turn session
holds its final context once, not 100 prompts (memory linear in the session, not
quadratic). A branch that leaves a chain starts a new buffer with a copy of its shared
prefix: the cost of a branching tree is the sum of its root-to-leaf sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infra.tree import TreeError

__all__ = ["Part", "expand_prompts", "expand_messages", "same_bytes", "shared_token_prefix", "shared_list_prefix"]


@dataclass(frozen=True, slots=True)
class Part:
    """One turn as the compact forms store it.

    ``shared`` leading items come from the parent's context (its full sequence followed
    by its ``output``); ``delta`` holds the items after them. A root shares nothing.
    Token parts carry packed bytes (``itemsize`` bytes per token), message parts lists.
    """

    node_id: str
    parent_id: str | None
    shared: int
    delta: Any
    output: Any


def _check_shared(part: Part, parent_ctx_len: int | None, unit: str) -> None:
    if part.shared < 0:
        raise TreeError(f"turn {part.node_id!r}: shared {unit} must be >= 0, got {part.shared}")
    if part.parent_id is None:
        if part.shared:
            raise TreeError(f"turn {part.node_id!r}: a root turn shares no {unit} (shared={part.shared})")
        return
    assert parent_ctx_len is not None
    if part.shared > parent_ctx_len:
        raise TreeError(
            f"turn {part.node_id!r}: shares {part.shared} {unit} with parent {part.parent_id!r}, whose "
            f"context has only {parent_ctx_len}"
        )


def expand_prompts(parts: Sequence[Part], *, itemsize: int = 4) -> dict[str, memoryview]:
    """Every turn's full prompt (packed bytes), as views over shared buffers.

    ``parts`` must be in parent-before-child order (:func:`infra.tree.topological_order`).
    Raises ``ValueError`` when a turn shares more than its parent's context holds.
    """
    in_len: dict[str, int] = {}
    ctx_len: dict[str, int] = {}
    children: dict[str, list[Part]] = {}
    for p in parts:
        _check_shared(p, None if p.parent_id is None else ctx_len[p.parent_id] // itemsize, "tokens")
        in_len[p.node_id] = p.shared * itemsize + len(p.delta)
        ctx_len[p.node_id] = in_len[p.node_id] + len(p.output)
        if p.parent_id is not None:
            children.setdefault(p.parent_id, []).append(p)
    prompt: dict[str, memoryview] = {}
    ctx: dict[str, memoryview] = {}
    for start in parts:
        if start.node_id in prompt:
            continue
        # A new buffer: the shared head (copied once), then this turn and the chain of
        # descendants that each extend the previous one's whole context.
        head: Any = b"" if start.parent_id is None else ctx[start.parent_id][: start.shared * itemsize]
        path = [start]
        while True:
            tip = path[-1]
            nxt = next(
                (
                    c
                    for c in children.get(tip.node_id, ())
                    if c.node_id not in prompt and c.shared * itemsize == ctx_len[tip.node_id]
                ),
                None,
            )
            if nxt is None:
                break
            path.append(nxt)
        pieces: list[Any] = [head]
        for p in path:
            pieces += (p.delta, p.output)
        view = memoryview(b"".join(pieces))
        for p in path:
            prompt[p.node_id] = view[: in_len[p.node_id]]
            ctx[p.node_id] = view[: ctx_len[p.node_id]]
    return prompt


def expand_messages(parts: Sequence[Part]) -> dict[str, list[Any]]:
    """Every turn's full message list (the items are shared, not copied); parents first."""
    full: dict[str, list[Any]] = {}
    outputs: dict[str, Sequence[Any]] = {}
    for p in parts:
        if p.parent_id is None:
            _check_shared(p, None, "messages")
            full[p.node_id] = list(p.delta)
        else:
            parent, parent_out = full[p.parent_id], outputs[p.parent_id]
            _check_shared(p, len(parent) + len(parent_out), "messages")
            head = parent[: p.shared]
            if p.shared > len(parent):
                head += parent_out[: p.shared - len(parent)]
            full[p.node_id] = head + list(p.delta)
        outputs[p.node_id] = p.output
    return full


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data) if len(buf) else 0


def same_bytes(a: Any, b: Any) -> bool:
    """``a == b`` for bytes-like objects, in O(1) when both view the same memory.

    Expanded prompts are views over one buffer per chain, so "does the child's prompt
    start with its parent's prompt?" compares a region with itself: answering that by
    address keeps checking a whole session linear instead of quadratic.
    """
    if len(a) != len(b):
        return False
    return _address(a) == _address(b) or np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))


def shared_token_prefix(parent_prompt: Any, parent_output: Any, prompt: Any, *, itemsize: int = 4) -> int:
    """How many leading tokens ``prompt`` shares with the parent's prompt + output.

    The common case (concat export: the whole context is shared) is two ``memcmp``s; a
    re-rendered history falls back to a vectorised scan for the first difference. Byte
    lengths must be multiples of ``itemsize``.
    """
    n_in, n_out = len(parent_prompt), len(parent_output)
    mv = memoryview(prompt)
    if (
        len(mv) >= n_in + n_out
        and same_bytes(mv[:n_in], parent_prompt)
        and same_bytes(mv[n_in : n_in + n_out], parent_output)
    ):
        return (n_in + n_out) // itemsize
    dtype = np.dtype(f"<i{itemsize}")
    a = np.concatenate([np.frombuffer(parent_prompt, dtype), np.frombuffer(parent_output, dtype)])
    b = np.frombuffer(prompt, dtype)
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def shared_list_prefix(parent_items: Sequence[Any], parent_output: Sequence[Any], items: Sequence[Any]) -> int:
    """How many leading items of ``items`` equal the parent's items followed by its output."""
    k = 0
    for ours, theirs in zip(items, (*parent_items, *parent_output)):
        if ours is not theirs and ours != theirs:
            break
        k += 1
    return k
