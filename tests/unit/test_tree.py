"""Tree tests: every consumer relies on these answers, so they are pinned exactly."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from infra.tree import TreeError, branches, topological_order


@dataclass(frozen=True)
class Node:
    interaction_id: str
    parent_id: str | None = None


def ids(nodes: list[Node]) -> list[str]:
    return [n.interaction_id for n in nodes]


#      a
#     / \
#    b   c
#    |
#    d
TREE = [Node("a"), Node("b", "a"), Node("c", "a"), Node("d", "b")]


@pytest.mark.parametrize("perm", list(itertools.permutations(TREE)))
def test_parent_before_child_for_any_input_order(perm: tuple[Node, ...]) -> None:
    order = ids(topological_order(list(perm)))
    assert sorted(order) == ["a", "b", "c", "d"]
    for node in TREE:
        if node.parent_id is not None:
            assert order.index(node.parent_id) < order.index(node.interaction_id)


def test_siblings_keep_input_order() -> None:
    assert ids(topological_order(TREE)) == ["a", "b", "d", "c"]
    assert ids(topological_order([Node("c", "a"), Node("b", "a"), Node("a")])) == ["a", "c", "b"]


def test_two_branches_share_the_root() -> None:
    paths = branches([Node("b2", "r"), Node("r"), Node("b1", "r")])
    assert [ids(p) for p in paths] == [["r", "b2"], ["r", "b1"]]
    assert paths[0][0] is paths[1][0]  # the shared root is the same object, not a copy


def test_deeper_tree_branches() -> None:
    assert [ids(p) for p in branches(TREE)] == [["a", "b", "d"], ["a", "c"]]


def test_linear_chain_is_one_branch() -> None:
    chain = [Node("t3", "t2"), Node("t1"), Node("t2", "t1")]
    assert [ids(p) for p in branches(chain)] == [["t1", "t2", "t3"]]


def test_forest_with_two_roots() -> None:
    forest = [Node("x"), Node("y"), Node("x1", "x"), Node("y1", "y")]
    order = ids(topological_order(forest))
    assert order == ["x", "x1", "y", "y1"]
    assert [ids(p) for p in branches(forest)] == [["x", "x1"], ["y", "y1"]]


def test_single_node() -> None:
    assert [ids(p) for p in branches([Node("only")])] == [["only"]]


def test_empty() -> None:
    assert topological_order([]) == [] and branches([]) == []


def test_duplicate_id() -> None:
    with pytest.raises(TreeError, match="duplicate interaction_id 'a'"):
        topological_order([Node("a"), Node("a")])


def test_unknown_parent() -> None:
    with pytest.raises(TreeError, match="interaction 'b' has unknown parent_id 'ghost'"):
        topological_order([Node("a"), Node("b", "ghost")])


def test_cycle() -> None:
    with pytest.raises(TreeError, match=r"cycle through \['x', 'y'\]"):
        topological_order([Node("root"), Node("x", "y"), Node("y", "x")])


def test_self_parent_is_a_cycle() -> None:
    with pytest.raises(TreeError, match=r"cycle through \['a'\]"):
        topological_order([Node("a", "a")])


def test_branches_validates_too() -> None:
    with pytest.raises(TreeError, match="duplicate"):
        branches([Node("a"), Node("a")])


def test_deep_chain_does_not_recurse() -> None:
    chain = [Node("n0")] + [Node(f"n{i}", f"n{i - 1}") for i in range(1, 5000)]
    (path,) = branches(chain[::-1])
    assert len(path) == 5000 and path[0].interaction_id == "n0"


def test_tree_error_is_value_error() -> None:
    assert issubclass(TreeError, ValueError)


def test_a_chain_in_order_comes_back_as_it_is() -> None:
    chain = [Node("a"), Node("b", "a"), Node("c", "b")]
    assert topological_order(chain) == chain and topological_order(chain) is not chain


def test_chain_shaped_input_is_still_validated() -> None:
    with pytest.raises(TreeError, match="duplicate interaction_id 'a'"):
        topological_order([Node("a"), Node("b", "a"), Node("a", "b")])  # looks like a chain, repeats an id
    with pytest.raises(TreeError, match="unknown parent_id 'ghost'"):
        topological_order([Node("a", "ghost"), Node("b", "a")])  # does not start at a root
