"""What an experiment-registry record may set on a scorer, and what only the operator may.

A registry record (``prm-pipeline experiment add``) comes from someone other than the
operator of the workers, and every worker applies it. A scorer's constructor arguments
are not all alike: some only tune scoring (a temperature, a vote count, a token
budget), others can **load code** (an ``hf:`` tokenizer, a ``module:callable`` chat
template or audit sink), **read the environment or a file** (``api_key_env``,
``api_key_file``, a tokenizer path) or **choose where data goes** (extra headers, a URL
path on the judge). So the capability model is:

* A scorer class declares the arguments a record may set as a frozen msgspec struct,
  :attr:`~scoring_workers.prm.BaseScorer.record_settings` (a :class:`RecordSettings`
  subclass: typed, bounded with ``Meta`` constraints, unknown fields refused). Every
  other constructor argument is **operator-only**; :attr:`~scoring_workers.prm.BaseScorer.operator_only`
  says why for the built-ins (messages and docs/security.md quote it). A class that
  declares nothing (a third-party scorer) exposes nothing but ``weight`` and ``enabled``.
* Operator-only arguments come from the operator's own worker config: a named
  **scorer profile** (``worker.scorer_profiles``) holds a scorer path and its
  operator-only kwargs; a record names the profile (``profile: NAME``) and may tune
  it with record-settable kwargs on top.
* Judge URLs a record sets (``base_url``...) are record-settable, but only within the
  worker's judge host allow-list (checked by the caller, :mod:`scoring_workers.fleet`),
  never with user info, and — on a profile that holds credentials — only among the
  profile's own URLs (:func:`~scoring_workers.judge.hosts.check_record_judge_urls`).

:func:`record_prm` turns a record's ``prm`` block into the block a worker builds, or
refuses it with one line naming the entry and the argument. The worker
(:class:`~scoring_workers.fleet.Fleet`) and ``experiment add`` both call it, so both
refuse the same records with the same words, before anything is built or sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec

from infra.config import ConfigError, PRMConfig, PRMScorerConfig, resolve_profile
from infra.types import did_you_mean, validating
from scoring_workers.judge.hosts import check_record_judge_urls

__all__ = [
    "CapabilityError",
    "RecordSettings",
    "constructor_arguments",
    "record_kwargs",
    "record_prm",
    "settable_fields",
]


class CapabilityError(ConfigError):
    """A registry record sets something only the operator's own config may set (or names an
    unknown profile); the message names the entry, the argument and the fix."""


class RecordSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of a scorer's record-settable arguments.

    Declare each field as ``T | msgspec.UnsetType = msgspec.UNSET`` with ``Meta`` bounds:
    a field the record leaves out stays unset and the constructor's (or the profile's)
    value applies.
    """


def settable_fields(cls: type) -> tuple[str, ...]:
    """The constructor arguments of ``cls`` a registry record may set."""
    settings = getattr(cls, "record_settings", None)
    if settings is None:
        return ()
    return tuple(f.encode_name for f in msgspec.structs.fields(settings))


def constructor_arguments(cls: type) -> list[str]:
    """Every keyword argument ``cls(...)`` takes beyond ``weight``/``enabled`` (its own and,
    through ``**kwargs`` handed up, its parents'), as the kwargs check reads them."""
    from scoring_workers.prm.resolve import _arguments

    arguments = _arguments(cls)
    return [] if arguments is None else [n for n in arguments[0] if n not in ("weight", "enabled")]


def _why_operator_only(cls: type, name: str) -> str:
    reasons: Mapping[str, str] = getattr(cls, "operator_only", None) or {}
    return reasons.get(name, "the scorer does not declare it record-settable")


def record_kwargs(cls: type, kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``kwargs`` of a record's scorer entry, checked against what ``cls`` lets records set.

    Returns the kwargs as plain data (only those the record gave).

    Raises:
        CapabilityError: an operator-only argument (with why), an unknown one (with the
            closest settable one), or a value outside the declared type and bounds.
    """
    settable = settable_fields(cls)
    for key in kwargs:
        if key in settable:
            continue
        if key in constructor_arguments(cls):
            raise CapabilityError(
                f"{where}.kwargs.{key}: operator-only ({_why_operator_only(cls, key)}); a registry record may "
                f"not set it: declare it in a profile of the workers' config (worker.scorer_profiles) and name "
                f"that profile in the entry (profile: NAME)"
            )
        match = did_you_mean(str(key), settable)
        hint = (
            f"did you mean `{match}`?"
            if match
            else (
                f"a record may set {', '.join(f'`{n}`' for n in settable)}"
                if settable
                else f"{cls.__name__} declares no record-settable arguments"
            )
        )
        raise CapabilityError(f"{where}.kwargs: {cls.__name__} has no record-settable argument `{key}`; {hint}")
    if not kwargs:
        return {}
    with validating(f"{where}.kwargs", root=cls.record_settings, error=CapabilityError):  # type: ignore[attr-defined]
        value = msgspec.convert(dict(kwargs), cls.record_settings, strict=True)  # type: ignore[attr-defined]
    return msgspec.to_builtins(value)


def _entries(prm: PRMConfig, key: str) -> Iterator[tuple[str, PRMScorerConfig]]:
    for index, entry in enumerate(prm.scorers):
        if not isinstance(entry, PRMScorerConfig):
            raise CapabilityError(f"{key}.scorers[{index}]: a registry record holds data, not scorer objects")
        yield f"{key}.scorers[{index}]", entry


def record_prm(
    prm: PRMConfig, profiles: Mapping[str, PRMScorerConfig], *, allowed_prefixes: Sequence[str] | None, key: str = "prm"
) -> PRMConfig:
    """The ``prm`` block a worker builds for a registry record's ``prm``.

    Each entry names a scorer ``path`` (under ``allowed_prefixes``) or an operator
    ``profile``; its kwargs must be record-settable for that class (:func:`record_kwargs`)
    and are laid over the profile's. The scorer module is imported to read its
    declaration — only after its path passed the allow-list.

    Raises:
        CapabilityError: see :func:`record_kwargs`; an unknown profile; path and profile both.
        ConfigError: a path outside ``allowed_prefixes``.
        ImportError, TypeError: the path does not name an importable scorer class.
    """
    from scoring_workers.prm.resolve import resolve_scorer_class

    out: list[PRMScorerConfig] = []
    for where, entry in _entries(prm, key):
        base = resolve_profile(entry, profiles, where, error=CapabilityError)
        try:
            cls = resolve_scorer_class(base.path, allowed_prefixes=allowed_prefixes)
        except (ImportError, TypeError, ConfigError) as exc:
            message = str(exc)
            raise type(exc)(message if message.startswith(where) else f"{where}: {message}") from None
        tuned = record_kwargs(cls, entry.kwargs or {}, where)
        check_record_judge_urls(base.kwargs if entry.profile is not None else {}, tuned, where, CapabilityError)
        out.append(
            PRMScorerConfig(
                base.path, weight=entry.weight, enabled=entry.enabled, kwargs={**(base.kwargs or {}), **tuned}
            )
        )
    return msgspec.structs.replace(prm, scorers=out)
