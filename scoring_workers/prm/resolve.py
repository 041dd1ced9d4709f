"""Turning ``rollout.agent.prm.scorers`` entries into scorer instances.

Entries are resolved as in AReaL: a :class:`BaseScorer` *instance* is borrowed (its
caller closes it); a :class:`PRMScorerConfig` or plain mapping is *owned* and built as
``cls(weight=, enabled=, **kwargs)`` from its import path ``"module.Class"``.

:data:`SCORER_ALIASES` is the fallback for paths whose module is not importable. It maps
AReaL's example path ``examples.prm.scorers.LengthBudgetScorer`` onto the built-in
:class:`scoring_workers.scorers.LengthBudgetScorer`, so configs written for AReaL work
without an ``examples`` package installed. A user whose own ``examples.prm.scorers``
module *is* importable gets that module, as AReaL would import it.

``allowed_prefixes`` lets a deployment restrict which modules a config may import
(config files are code execution otherwise). It is checked against the module that
would actually be imported, i.e. after alias lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import msgspec

from infra.config import ConfigError, PRMScorerConfig
from scoring_workers.prm.base import BaseScorer

__all__ = ["SCORER_ALIASES", "resolve_scorer_class", "build_scorer"]

SCORER_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        # AReaL's example path -> our built-in (same behaviour, same name "length_budget").
        "examples.prm.scorers.LengthBudgetScorer": "scoring_workers.scorers.LengthBudgetScorer",
    }
)


_ENTRY_KEYS = frozenset(f.encode_name for f in msgspec.structs.fields(PRMScorerConfig))


def _module_allowed(module: str, prefixes: Sequence[str]) -> bool:
    for prefix in prefixes:
        base = prefix.rstrip(".")
        if base and (module == base or module.startswith(base + ".")):
            return True
    return False


def resolve_scorer_class(path: str, *, allowed_prefixes: Sequence[str] | None = None) -> type[BaseScorer]:
    """Import ``"module.Class"`` (after alias lookup) and check it is a scorer class.

    Raises:
        ValueError: (:class:`~infra.config.ConfigError`) empty or malformed path, or a
            module outside ``allowed_prefixes`` (``None`` allows any module).
        ImportError: the module cannot be imported or has no such attribute.
        TypeError: the attribute is not a :class:`BaseScorer` subclass.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"scorer path must be a non-empty 'module.Class' string, got {path!r}")
    path = path.strip()
    alias = SCORER_ALIASES.get(path)
    prefixes = None
    if allowed_prefixes is not None:
        prefixes = [allowed_prefixes] if isinstance(allowed_prefixes, str) else list(allowed_prefixes)
    if alias is not None:
        own_module = path.rpartition(".")[0]
        if prefixes is None or _module_allowed(own_module, prefixes):
            try:  # the user's own module first, as AReaL imports the path
                return _resolve(path, path, None)
            except ModuleNotFoundError as exc:
                if not (exc.name and (own_module == exc.name or own_module.startswith(exc.name + "."))):
                    raise  # the module exists but one of *its* imports is missing: say so
        return _resolve(path, alias, prefixes)
    return _resolve(path, path, prefixes)


def _resolve(path: str, target: str, prefixes: Sequence[str] | None) -> type[BaseScorer]:
    module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"scorer path {path!r} must have the form 'module.Class'")
    if prefixes is not None and not _module_allowed(module_name, prefixes):
        via = "" if target == path else f" (alias of {target!r})"
        raise ConfigError(
            f"scorer path {path!r}{via} is refused: module {module_name!r} is not under the "
            f"allowed prefixes {prefixes}; add its package to the worker's allowed scorer modules"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        exc.add_note(
            f"while resolving PRM scorer path {path!r}; built-in aliases: {dict(SCORER_ALIASES)}"
        )
        raise
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise ImportError(f"scorer path {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseScorer)):
        raise TypeError(
            f"scorer path {path!r} names {cls!r}, which is not a subclass of "
            "scoring_workers.prm.BaseScorer"
        )
    return cls


def build_scorer(
    item: BaseScorer | PRMScorerConfig | Mapping[str, Any], *, allowed_prefixes: Sequence[str] | None = None
) -> tuple[BaseScorer, bool]:
    """Return ``(scorer, owned)`` for one ``scorers`` entry (see the module docstring).

    A mapping is converted with the same rules as YAML (``path``, ``weight``,
    ``enabled``, ``kwargs``; unknown keys are refused). Errors raised by the scorer's
    own constructor propagate unchanged.
    """
    if isinstance(item, BaseScorer):
        return item, False
    if isinstance(item, type) and issubclass(item, BaseScorer):
        raise TypeError(
            f"scorers entry {item.__qualname__} is a class; pass an instance (borrowed) or a "
            "PRMScorerConfig / mapping with its import path (owned)"
        )
    if isinstance(item, Mapping):
        raw = dict(item)
        unknown = sorted(str(k) for k in raw if k not in _ENTRY_KEYS)
        if unknown:
            raise ConfigError(
                f"scorer entry {raw!r}: unknown keys {unknown} (allowed: {sorted(_ENTRY_KEYS)}; "
                "scorer arguments go under 'kwargs')"
            )
        try:
            item = msgspec.convert(raw, PRMScorerConfig, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid scorer entry {raw!r}: {exc}") from None
    if not isinstance(item, PRMScorerConfig):
        raise TypeError(
            f"scorers entries must be BaseScorer instances, PRMScorerConfig or mappings, got "
            f"{type(item).__name__}"
        )
    cls = resolve_scorer_class(item.path, allowed_prefixes=allowed_prefixes)
    kwargs = dict(item.kwargs or {})
    clash = sorted({"weight", "enabled"} & set(kwargs))
    if clash:
        raise ConfigError(f"scorer {item.path!r}: set {clash} at the entry level, not inside kwargs")
    return cls(weight=item.weight, enabled=item.enabled, **kwargs), True
