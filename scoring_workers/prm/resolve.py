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
An aliased path whose own module *is* importable but not allowed is refused with a
message that says so (:func:`resolve_import`): silently scoring with the built-in
instead of the user's scorer would produce different rewards with no sign of it.

A module that cannot be imported raises :class:`ImportError` (as in AReaL) whose
message is one line with the fix (install the package or set ``PYTHONPATH``), and a
scorer's ``kwargs`` are checked against its constructor's signature before it is built
(:func:`check_scorer_kwargs`), so a typo is named with the closest argument instead of
surfacing as a traceback from inside the constructor. :func:`check_scorer_entries`
runs both checks for a whole ``prm`` block without building anything, which is what the
CLI does before it waits for Kafka and Redis.

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
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from infra.config import ConfigError, PRMConfig, PRMScorerConfig, check_scorer_entry_keys
from infra.types import did_you_mean, validating
from scoring_workers.prm.base import BaseScorer

__all__ = [
    "SCORER_ALIASES",
    "ResolvedScorer",
    "ScorerArgumentError",
    "allowed_modules",
    "build_scorer",
    "check_scorer_entries",
    "check_scorer_kwargs",
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


class ScorerArgumentError(ConfigError, TypeError):
    """A scorer entry's ``kwargs`` do not fit the scorer's constructor.

    A :class:`~infra.config.ConfigError` (the CLI reports it in one line, exit 2) and a
    :class:`TypeError`, which is what the constructor itself would raise (as in AReaL).
    """


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
        raise _import_failure(what, spec, module_name, exc) from exc
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            match = did_you_mean(part, [n for n in dir(value) if not n.startswith("_")])
            hint = f"; did you mean {match!r}?" if match else ""
            raise ImportError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}{hint}") from None
    return value


def _missing_itself(module_name: str, exc: ImportError) -> bool:
    """Whether ``exc`` says ``module_name`` (or a package above it) does not exist, as
    opposed to the module existing and one of *its* imports failing."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    return bool(missing) and (module_name == missing or module_name.startswith(f"{missing}."))


def _import_failure(what: str, spec: str, module_name: str, exc: ImportError) -> ImportError:
    """The same kind of ImportError (``name`` kept: alias fallback reads it), one line with the fix."""
    if _missing_itself(module_name, exc):
        message = (
            f"{what} {spec!r}: module {module_name!r} is not importable ({exc}); install the package "
            "that provides it in the worker's environment, or add the directory that contains it "
            "to PYTHONPATH"
        )
    else:
        message = (
            f"{what} {spec!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}; "
            "install what it needs in the worker's environment"
        )
    kind = ModuleNotFoundError if isinstance(exc, ModuleNotFoundError) else ImportError
    return kind(message, name=exc.name, path=exc.path)


def _locate(module_name: str) -> str | None:
    """Where ``module_name`` would be imported from, found without running any code
    (its parent packages are not imported); None when it cannot be found."""
    if module_name in sys.modules:
        module = sys.modules[module_name]
        return getattr(module, "__file__", None) or module_name
    search: Sequence[str] | None = None
    origin: str | None = None
    parts = module_name.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        if name in sys.modules:
            module = sys.modules[name]
            search, origin = getattr(module, "__path__", None), getattr(module, "__file__", None)
        else:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                try:
                    spec = find(name, search) if find is not None else None
                except (ImportError, ValueError, TypeError):
                    spec = None  # a finder that cannot answer for this name
                if spec is not None:
                    break
            if spec is None:
                return None
            search, origin = spec.submodule_search_locations, spec.origin
            if origin in (None, "namespace") and search:
                origin = next(iter(search), None)
        if search is None and i < len(parts) - 1:
            return None  # a plain module where a package is needed
    return origin or module_name


def resolve_import(spec: str, what: str, *, allowed_prefixes: Sequence[str] | str | None | object = _CONTEXT) -> Any:
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
        _near_alias(what, path, prefixes)
        return _load(what, path, path, prefixes)
    own_module, _ = _split(what, path, path)
    if prefixes is None or _module_allowed(own_module, prefixes):
        try:  # the user's own module first, as AReaL imports the path
            return _load(what, path, path, prefixes)
        except ModuleNotFoundError as exc:
            if not _missing_itself(own_module, exc):
                raise  # the module exists but one of *its* imports is missing: say so
    elif (found := _locate(own_module)) is not None:
        raise ConfigError(
            f"{what} {path!r}: your module {own_module!r} ({found}) is importable but not under "
            f"worker.allowed_scorer_modules {list(prefixes)}, so the built-in {alias!r} would replace it "
            f"silently; add {own_module!r} to worker.allowed_scorer_modules "
            f"to use yours, or name {alias!r} to use the built-in"
        )
    return _load(what, path, alias, prefixes)


def _near_alias(what: str, path: str, prefixes: tuple[str, ...] | None) -> None:
    """A path in an aliased module (``examples.prm.scorers``) that is not an alias itself: when
    that module is not the user's own (not importable, or not allowed and not found), the
    attribute is a typo of an alias — say which, as :func:`_load` does for any other module,
    instead of allow-list advice or "not importable" about a module that never existed."""
    module_name, _, attr = path.rpartition(".")
    names = {a.rpartition(".")[2]: a for a in SCORER_ALIASES if a.rpartition(".")[0] == module_name}
    if not names:
        return
    allowed = prefixes is None or _module_allowed(module_name, prefixes)
    if allowed:
        try:
            importlib.import_module(module_name)
            return  # the user's own module: _load names its attributes
        except ModuleNotFoundError as exc:
            if not _missing_itself(module_name, exc):
                return  # it exists, one of its imports is missing: _load says so
    elif _locate(module_name) is not None:
        return  # the user's own module, not allowed: _load refuses it with the allow-list advice
    match = did_you_mean(attr, list(names))
    hint = f"; did you mean {match!r}?" if match else f"; it provides {sorted(names)}"
    raise ImportError(
        f"{what} {path!r}: {module_name!r} (AReaL's example module, provided built in) has no attribute {attr!r}{hint}",
        name=module_name,
    )


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
            f"scorer path {path!r} names {cls!r}, which is not a subclass of scoring_workers.prm.BaseScorer"
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
    entry = _entry(item, f"scorer entry {dict(item)!r}" if isinstance(item, Mapping) else "scorer entry")
    cls = resolve_scorer_class(entry.path, allowed_prefixes=allowed_prefixes)
    kwargs = dict(entry.kwargs or {})
    check_scorer_kwargs(cls, kwargs, f"scorer {entry.path!r}")
    with allowed_modules(allowed_prefixes):  # paths in kwargs obey the same allow-list
        return cls(weight=entry.weight, enabled=entry.enabled, **kwargs), True


def _entry(item: Any, where: str) -> PRMScorerConfig:
    """A mapping or :class:`PRMScorerConfig` as a :class:`PRMScorerConfig` (YAML's rules)."""
    if isinstance(item, Mapping):
        raw = dict(item)
        check_scorer_entry_keys(raw, where)
        with validating(root=PRMScorerConfig, error=lambda text: ConfigError(f"invalid {where}: {text}")):
            item = msgspec.convert(raw, PRMScorerConfig, strict=False)
    if not isinstance(item, PRMScorerConfig):
        raise TypeError(
            f"scorers entries must be BaseScorer instances, PRMScorerConfig or mappings, got {type(item).__name__}"
        )
    return item


def _arguments(cls: type) -> tuple[list[str], list[str], bool] | None:
    """``(keyword arguments cls(...) is known to accept, those it requires, open)``.

    ``open``: the constructor takes ``**kwargs``. It is then assumed to hand them to
    ``super().__init__`` (as AReaL's scorers do), so its parents' arguments count too, up
    to the first ``__init__`` without ``**kwargs``. Required arguments are read from the
    class's own constructor only: a subclass may supply its parents' itself. None when
    the signature cannot be read.
    """
    names: list[str] = []
    required: list[str] = []
    first = True
    takes_more = False
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        try:
            params = list(inspect.signature(init).parameters.values())[1:]  # without self
        except (TypeError, ValueError):
            return None
        more = False
        for p in params:
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                more = True
            elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                if p.name not in names:
                    names.append(p.name)
                if first and p.default is inspect.Parameter.empty:
                    required.append(p.name)
        takes_more = takes_more or (first and more)
        first = False
        if not more:
            break
    return names, required, takes_more


def check_scorer_kwargs(cls: type, kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse ``kwargs`` that ``cls(weight=, enabled=, **kwargs)`` would not accept.

    A constructor without ``**kwargs`` takes exactly its named arguments (and, through
    ``**kwargs`` handed up, its parents'). One that takes ``**kwargs`` may use them for
    anything, so there only a near-miss of a known argument is refused.

    Raises:
        ScorerArgumentError: an argument the constructor does not take (with the closest
            one it does), ``weight`` / ``enabled`` inside ``kwargs``, or a required one
            missing.
    """
    clash = sorted({"weight", "enabled"} & set(kwargs))
    if clash:
        raise ScorerArgumentError(f"{where}: set {clash} at the entry level, not inside kwargs")
    arguments = _arguments(cls)
    if arguments is None:
        return
    names, required, takes_more = arguments
    takes = [n for n in names if n not in ("weight", "enabled")]
    for key in kwargs:
        if key in names:
            continue
        match = did_you_mean(str(key), names)
        if takes_more and match is None:
            continue  # the constructor's own **kwargs: it decides
        hint = (
            f"did you mean `{match}`?"
            if match
            else (f"it takes {', '.join(f'`{n}`' for n in takes)}" if takes else "it takes none")
        )
        if match in ("weight", "enabled"):
            hint += " (set it at the entry level, not inside kwargs)"
        raise ScorerArgumentError(f"{where}: kwargs: {cls.__name__} got an unexpected keyword argument `{key}`; {hint}")
    missing = [n for n in required if n not in kwargs and n not in ("weight", "enabled")]
    if missing:
        raise ScorerArgumentError(f"{where}: kwargs: {cls.__name__} needs {', '.join(f'`{n}`' for n in missing)}")


@dataclass(frozen=True, slots=True)
class ResolvedScorer:
    """One configured scorer entry, resolved but not built (what a worker will run)."""

    index: int
    path: str  # as configured
    target: str  # ``module.Class`` actually imported (differs from ``path`` for an alias)
    cls: type[BaseScorer]
    weight: float
    enabled: bool


def check_scorer_entries(
    prm: PRMConfig, *, allowed_prefixes: Sequence[str] | None = None, key: str = "rollout.agent.prm"
) -> list[ResolvedScorer]:
    """Resolve every configured scorer entry and check its ``kwargs``, building nothing.

    The checks :func:`build_scorer` makes before it calls a constructor, for the whole
    block, each error prefixed with the entry's key (``key``: ``rollout.agent.prm.scorers[1]``):
    commands run this before they wait for Kafka and Redis, so a typo or a missing
    package is reported at once. Scorer instances (built in Python) are skipped.

    Raises:
        ValueError: (:class:`~infra.config.ConfigError`) refused or malformed path, bad
            entry, or :class:`ScorerArgumentError`.
        ImportError: the module cannot be imported or has no such class.
        TypeError: the path names something that is not a scorer class.
    """
    resolved = []
    for index, item in enumerate(prm.scorers):
        if isinstance(item, BaseScorer):
            continue
        where = f"{key}.scorers[{index}]"
        try:
            entry = _entry(item, where)
            cls = resolve_scorer_class(entry.path, allowed_prefixes=allowed_prefixes)
            check_scorer_kwargs(cls, dict(entry.kwargs or {}), where)
        except (ConfigError, ImportError, TypeError) as exc:
            message = str(exc)
            if not message.startswith(where):
                message = f"{where}: {message}"
            raise _same_kind(exc, message) from exc
        resolved.append(
            ResolvedScorer(index, entry.path, f"{cls.__module__}.{cls.__qualname__}", cls, entry.weight, entry.enabled)
        )
    return resolved


def _same_kind(exc: Exception, message: str) -> Exception:
    if isinstance(exc, ImportError):
        kind = ModuleNotFoundError if isinstance(exc, ModuleNotFoundError) else ImportError
        return kind(message, name=exc.name, path=exc.path)
    if isinstance(exc, ScorerArgumentError):
        return ScorerArgumentError(message)
    if isinstance(exc, ConfigError):
        return ConfigError(message)
    return TypeError(message)
