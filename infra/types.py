"""The shared constrained types, and the one place a msgspec ``ValidationError`` becomes ours.

Every boundary of the project (the config file, registry records, JSONL lines, gateway
bodies, judge settings, a scorer's record-settable arguments) is a msgspec struct whose
fields carry ``Meta`` bounds. The bounds that mean the same thing everywhere are defined
here once: a duration, a pause, a token id, a finite number, a 64-bit integer. A field
with a tighter bound of its own (a registry record may set a judge timeout of at most an
hour) spells that bound out beside its reason.

:func:`validating` is the boundary: a ``ValidationError`` raised inside it becomes the
caller's error class with one wording: ``path: problem``, the path in the document's own
terms (``worker.scorer_timeout_s``, ``interactions[0].output_tokens[3]``), the problem
saying what was expected, and for an unknown key the closest valid one.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi

from infra.errors import ConfigError

__all__ = [
    "MAX_SECONDS",
    "MAX_TOKEN_ID",
    "Delay",
    "Explanation",
    "Finite",
    "Int64",
    "Seconds",
    "TokenId",
    "did_you_mean",
    "explain",
    "validating",
]

MAX_SECONDS = 1e9
"""The longest duration any setting takes (about 31 years): a bound, so that ``.inf`` is refused."""
MAX_TOKEN_ID = 2**31 - 1
"""Token ids travel as int32 (AReaL's tensors, the wire's packed arrays): at most this."""

Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS, description="a duration in seconds, above zero")]
"""A duration (a timeout, an interval): finite, above zero."""
Delay = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS, description="a pause in seconds, zero or more")]
"""A pause that may be zero (a backoff: zero retries at once)."""
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID, description="a token id: int32, non-negative")]
"""A vocabulary index: non-negative, fits in int32."""
Finite = Annotated[
    float, msgspec.Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308, description="a finite number")
]
"""A float that is neither infinite nor NaN (NaN fails both bounds)."""
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1, description="a 64-bit integer")]
"""An integer msgpack and Kafka headers carry as a signed 64-bit value."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (difflib), or None when nothing is close."""
    pool = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(word.lower(), list(pool), n=1, cutoff=0.6)
    return pool[match[0]] if match else None


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>.*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<key>.*)`$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[\.\.\.\]")


def _node(info: Any, step: str | int | None) -> Any:
    """The type one step (a field name, a list index, a dict value: None) inside ``info``."""
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):  # ``X | None``: the member that has the step
        members = [_node(t, step) for t in info.types]
        return next((m for m in members if m is not None), None)
    if isinstance(info, (mi.StructType, mi.DataclassType, mi.TypedDictType)) and isinstance(step, str):
        return next((f.type for f in info.fields if f.encode_name == step), None)
    if isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)) and isinstance(step, int):
        return info.item_type
    if isinstance(info, mi.DictType) and step is None:
        return info.value_type
    return None


def _type_at(root: Any, path: str) -> Any:
    """The msgspec type info at ``path`` (msgspec's ``.a[0].b``) inside ``root``, or None."""
    try:
        info: Any = mi.type_info(root)
    except (TypeError, ValueError):
        return None
    for m in _STEP.finditer(path):
        name, index = m.group(1), m.group(2)
        info = _node(info, name if name is not None else int(index) if index is not None else None)
        if info is None:
            return None
    return info


def _keys(info: Any) -> list[str]:
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):
        return [k for t in info.types for k in _keys(t)]
    if isinstance(info, (mi.StructType, mi.DataclassType, mi.TypedDictType)):
        return [f.encode_name for f in info.fields]
    return []


def _description(info: Any) -> str | None:
    while isinstance(info, mi.Metadata):
        described = (info.extra_json_schema or {}).get("description")
        if described:
            return str(described)
        info = info.type
    return None


class Explanation(str):
    """The text of :func:`explain`, with msgspec's own text beside it as ``raw``, for an
    interface that promised that wording (the gateway's 400 bodies: ``<problem> - at `$.path```)."""

    raw: str


def explain(exc: msgspec.ValidationError, root: Any = None, where: str = "") -> Explanation:
    """``exc`` in the project's words: ``where.path: problem``.

    ``root`` (the type that was being decoded) lets an unknown key name the closest valid
    one and a bounded field say what it holds (its ``Meta`` description). msgspec's own
    text stays in the problem: it names the type and the bound that failed.
    """
    m = _AT.match(str(exc))
    assert m is not None  # the pattern matches any string
    problem, path = m["msg"], m["path"] or ""
    if unknown := _UNKNOWN.match(problem):
        key, keys = unknown["key"], _keys(_type_at(root, path)) if root is not None else []
        match = did_you_mean(key, keys)
        problem = f"unknown key `{key}`" + (
            f"; did you mean `{match}`?" if match else f"; valid keys: {', '.join(sorted(keys))}" if keys else ""
        )
    elif missing := _MISSING.match(problem):
        path, problem = f"{path}.{missing['key']}", "missing required field"
    else:
        described = _description(_type_at(root, path)) if root is not None and path else None
        problem += f" ({described})" if described else ""
    path = path.lstrip(".")
    if path and problem.startswith((f"{path}.", f"{path}[", f"{path}:")):
        path = ""  # a struct's own rule (its __post_init__) already names the field it is about
    if where:
        path = f"{where}{'' if not path or path.startswith('[') else '.'}{path}"
    text = Explanation(f"{path}: {problem}" if path else problem)
    text.raw = str(exc)
    return text


@contextmanager
def validating(
    where: str = "", *, root: Any = None, error: Callable[[Explanation], Exception] = ConfigError
) -> Iterator[None]:
    """Turn a msgspec ``ValidationError`` raised inside into ``error(explain(...))``.

    ``where``: the path of the document being checked (``prm``, ``worker.scorer_profiles.x``),
    prefixed to the field path; ``root``: the type being decoded (see :func:`explain`);
    ``error``: the caller's error class, or a function building it from the text (a
    :class:`~infra.errors.ConfigError` by default). The cause is dropped: the text says it all.
    """
    try:
        yield
    except msgspec.ValidationError as exc:
        raise error(explain(exc, root, where)) from None
