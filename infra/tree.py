"""Interaction trees: validation, parent-before-child order and root-to-leaf branches.

A trajectory's turns form a forest through ``parent_id`` links. Every consumer of the
wire format (the schema's boundary validation, the PRM runner, the trainer's batch
builder) needs the same three answers — is the tree well formed, in which order may
turns be visited, and which root-to-leaf paths exist — so they live here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from infra.errors import WireError


class TreeError(WireError, ValueError):
    """The parent links do not form a forest (duplicate id, unknown parent, cycle)."""


class _Node(Protocol):
    @property
    def interaction_id(self) -> str: ...

    @property
    def parent_id(self) -> str | None: ...


N = TypeVar("N", bound=_Node)


def topological_order(nodes: Sequence[N]) -> list[N]:
    """Return ``nodes`` parent-before-child, siblings in input order.

    Raises :class:`TreeError` for duplicate ids, a parent id that names no node, or a
    cycle (nodes unreachable from any root).

    A single chain already in order (each node's parent is the node before it: every
    linear session) is recognised in one pass and returned as it is; anything else
    takes the general walk. Callers check a trajectory's tree several times per record,
    so the common case must be cheap.
    """
    previous = None
    for node in nodes:
        if node.parent_id != previous:
            break
        previous = node.interaction_id
    else:  # a chain from a root; a repeated id is the only way it can be malformed
        if len({node.interaction_id for node in nodes}) == len(nodes):
            return list(nodes)
    by_id: dict[str, N] = {}
    for node in nodes:
        if node.interaction_id in by_id:
            raise TreeError(f"duplicate interaction_id {node.interaction_id!r}")
        by_id[node.interaction_id] = node
    children: dict[str | None, list[N]] = {}
    for node in nodes:
        parent = node.parent_id
        if parent is not None and parent not in by_id:
            raise TreeError(f"interaction {node.interaction_id!r} has unknown parent_id {parent!r}")
        children.setdefault(parent, []).append(node)
    order: list[N] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children.get(node.interaction_id, [])))
    if len(order) != len(nodes):
        reached = {n.interaction_id for n in order}
        stuck = sorted(i for i in by_id if i not in reached)
        raise TreeError(f"parent links form a cycle through {stuck}")
    return order


def branches(nodes: Sequence[N]) -> list[list[N]]:
    """Every root-to-leaf path, each ordered root first, leaves in topological order."""
    order = topological_order(nodes)
    by_id = {n.interaction_id: n for n in order}
    has_child = {n.parent_id for n in order if n.parent_id is not None}
    paths: list[list[N]] = []
    for leaf in order:
        if leaf.interaction_id in has_child:
            continue
        path = [leaf]
        while path[-1].parent_id is not None:
            path.append(by_id[path[-1].parent_id])
        path.reverse()
        paths.append(path)
    return paths
