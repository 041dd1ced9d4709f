"""Read-only copies of chat messages handed to scorers.

Scorers can be shared by concurrent sessions and every branch of a trajectory is
scored on its own clone, so a scorer that edited ``ctx["messages"]`` or an
interaction's ``messages`` in place would corrupt other branches, other scorers and
the caller's trajectory. Rather than deep-copying per scorer call (measured ~4x
slower than freezing, and a copy is still mutable for the next scorer) the runner
freezes each message tree once per run: dicts become :class:`FrozenDict`, lists
become tuples, scalars are shared (they are immutable already).

:class:`FrozenDict` subclasses :class:`dict` on purpose: ``json.dumps``,
``msgspec.json.encode`` and HTTP clients accept it unchanged, which a
``MappingProxyType`` would break for every LLM-judge scorer. ``copy.deepcopy`` and
``pickle`` turn it back into a plain, mutable ``dict`` for scorers that want to edit
a private copy.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn

__all__ = ["FrozenDict", "freeze"]


class FrozenDict(dict):
    """A ``dict`` whose mutating methods raise :class:`TypeError`."""

    __slots__ = ()

    def _readonly(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "PRM scorer inputs are read-only; build a new dict (dict(message)) or "
            "copy.deepcopy() the messages to get a private, mutable copy"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly
    __ior__ = _readonly

    def __copy__(self) -> dict[Any, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:
        return {key: copy.deepcopy(value, memo) for key, value in self.items()}

    def __reduce__(self) -> tuple[type, tuple[dict[Any, Any]]]:
        return (dict, (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


_SCALARS = frozenset({str, int, float, bool, type(None), bytes})


def freeze(obj: Any) -> Any:
    """Return ``obj`` with every dict frozen and every list turned into a tuple.

    Scalars are returned as they are; other objects are deep-copied (messages decoded
    from the wire never contain them, so this path only guards hand-built inputs).
    Dicts whose values are all scalars — most chat messages — are frozen without
    recursing, which keeps the common case at one C-level dict copy.
    """
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    if kind is dict or kind is FrozenDict:
        for value in obj.values():
            if type(value) not in _SCALARS:
                return FrozenDict({k: (v if type(v) in _SCALARS else freeze(v)) for k, v in obj.items()})
        return obj if kind is FrozenDict else FrozenDict(obj)
    if kind is list or kind is tuple:
        return tuple([v if type(v) in _SCALARS else freeze(v) for v in obj])
    if isinstance(obj, dict):
        return FrozenDict({k: freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return tuple(freeze(v) for v in obj)
    return copy.deepcopy(obj)
