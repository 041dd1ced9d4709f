"""Turning ``rollout.agent.prm.scorers`` entries into scorer instances.

Entries are resolved as in AReaL: a :class:`BaseScorer` *instance* is borrowed (its
caller closes it); a :class:`PRMScorerConfig` or plain mapping is *owned* and built as
``cls(weight=, enabled=, **kwargs)`` from its import path ``"module.Class"``.

:data:`SCORER_ALIASES` is the fallback for paths whose module is not importable. It maps
AReaL's example path ``examples.prm.scorers.LengthBudgetScorer`` onto the built-in
:class:`scoring_workers.scorers.LengthBudgetScorer`, so configs written for AReaL work
without an ``examples`` package installed. A user whose own ``examples.prm.scorers``
module *is* importable gets that module, as AReaL would import it.

``allowed_prefixes`` (``worker.allowed_scorer_modules``) lets a deployment restrict
which modules a config may import (config files are code execution otherwise). It is
checked against the module that would actually be imported, i.e. after alias lookup.

:func:`resolve_import` is the **one** resolver for everything a config names by import
path — scorer classes, and the callables a scorer's ``kwargs`` name (a judge's
``chat_template`` and ``audit_sink``, an OPD ``tokenizer``) — and the one place the
allow-list is enforced, with one error message. A scorer's constructor cannot take the
allow-list as an argument (its signature is AReaL's ``cls(weight=, enabled=,
**kwargs)``), so :func:`build_scorer` makes it the *context* of the construction
(:func:`allowed_modules`, a :class:`contextvars.ContextVar`): a path resolved while the
scorer is being built is held to the same prefixes as the scorer's own path.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

import msgspec

from infra.config import ConfigError, PRMScorerConfig
from scoring_workers.prm.base import BaseScorer

__all__ = [
    "SCORER_ALIASES",
    "allowed_modules",
    "build_scorer",
    "resolve_callable",
    "resolve_import",
    "resolve_scorer_class",
]

SCORER_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        # AReaL's example path -> our built-in (same behaviour, same name "length_budget").
        "examples.prm.scorers.LengthBudgetScorer": "scoring_workers.scorers.LengthBudgetScorer",
    }
)


_ENTRY_KEYS = frozenset(f.encode_name for f in msgspec.structs.fields(PRMScorerConfig))


_ALLOWED: ContextVar[tuple[str, ...] | None] = ContextVar("prm_allowed_modules", default=None)


def _prefixes(allowed: Sequence[str] | str | None) -> tuple[str, ...] | None:
    if allowed is None:
        return None
    return (allowed,) if isinstance(allowed, str) else tuple(allowed)


@contextlib.contextmanager
def allowed_modules(prefixes: Sequence[str] | str | None) -> Iterator[None]:
    """Within this block, :func:`resolve_import` (without an explicit ``allowed_prefixes``)
    only imports modules under ``prefixes`` (``None``: any module)."""
    token = _ALLOWED.set(_prefixes(prefixes))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def _module_allowed(module: str, prefixes: Sequence[str]) -> bool:
    for prefix in prefixes:
        base = prefix.rstrip(".")
        if base and (module == base or module.startswith(base + ".")):
            return True
    return False


_CONTEXT = object()  # sentinel: take the allow-list from allowed_modules()


def _split(what: str, spec: str, target: str) -> tuple[str, str]:
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} must have the form 'module.attr' or 'module:attr'")
    return module_name, attr


def _load(what: str, spec: str, target: str, prefixes: tuple[str, ...] | None) -> Any:
    """Import ``target`` (the path itself or its alias), checking the allow-list first."""
    module_name, attr = _split(what, spec, target)
    if prefixes is not None and not _module_allowed(module_name, prefixes):
        via = "" if target == spec else f" (alias of {target!r})"
        raise ConfigError(
            f"{what} {spec!r}{via} is refused: module {module_name!r} is not under the allowed prefixes "
            f"{list(prefixes)}; add its package to worker.allowed_scorer_modules"
        )
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        exc.add_note(f"while resolving {what} {spec!r}; built-in aliases: {dict(SCORER_ALIASES)}")
        raise
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ImportError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    return value


def resolve_import(
    spec: str, what: str, *, allowed_prefixes: Sequence[str] | str | None | object = _CONTEXT
) -> Any:
    """The object a config names by ``"module:attr"`` or ``"module.attr"``.

    ``allowed_prefixes`` defaults to the enclosing :func:`allowed_modules` block (none:
    any module). ``what`` names the setting in messages (``"scorer path"``,
    ``"chat_template"``...). A path in :data:`SCORER_ALIASES` imports the user's own
    module when it exists (and is allowed), as AReaL would, and the alias otherwise.

    Raises:
        ValueError: (:class:`~infra.config.ConfigError`) empty or malformed path, or a
            module outside the allowed prefixes — checked *before* anything is imported.
        ImportError: the module cannot be imported or has no such attribute.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{what} must be a non-empty import path 'module.attr' or 'module:attr', got {spec!r}")
    path = spec.strip()
    prefixes = _ALLOWED.get() if allowed_prefixes is _CONTEXT else _prefixes(allowed_prefixes)  # type: ignore[arg-type]
    alias = SCORER_ALIASES.get(path)
    if alias is None:
        return _load(what, path, path, prefixes)
    own_module, _ = _split(what, path, path)
    if prefixes is None or _module_allowed(own_module, prefixes):
        try:  # the user's own module first, as AReaL imports the path
            return _load(what, path, path, prefixes)
        except ModuleNotFoundError as exc:
            if not (exc.name and (own_module == exc.name or own_module.startswith(exc.name + "."))):
                raise  # the module exists but one of *its* imports is missing: say so
    return _load(what, path, alias, prefixes)


def resolve_callable(spec: Any, what: str) -> Callable[..., Any]:
    """A callable given directly, or by import path through :func:`resolve_import`."""
    if callable(spec):
        return spec
    target = resolve_import(spec, what)
    if not callable(target):
        raise TypeError(f"{what} {spec!r} is not callable")
    return target


def resolve_scorer_class(path: str, *, allowed_prefixes: Sequence[str] | None = None) -> type[BaseScorer]:
    """Import ``"module.Class"`` (after alias lookup) and check it is a scorer class.

    Raises:
        ValueError: (:class:`~infra.config.ConfigError`) empty or malformed path, or a
            module outside ``allowed_prefixes`` (``None`` allows any module).
        ImportError: the module cannot be imported or has no such attribute.
        TypeError: the attribute is not a :class:`BaseScorer` subclass.
    """
    cls = resolve_import(path, "scorer path", allowed_prefixes=allowed_prefixes)
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
    with allowed_modules(allowed_prefixes):  # paths in kwargs obey the same allow-list
        return cls(weight=item.weight, enabled=item.enabled, **kwargs), True
