"""Which judge hosts a worker may send trajectories to, and how a judge is named in metrics.

A judge endpoint receives trajectory text, so where it points is a security decision.
``worker.allowed_judge_hosts`` is the operator's list of hosts; the worker's own config
file is written by the operator too, so the default (``null``) allows exactly the hosts
that file names. Anything that may name a judge URL *without* being the operator's file
(an experiment registry record, for instance) must go through :func:`effective_allow_list`,
and with an explicit list every judge URL — the config file's included — must match it.

* :class:`HostAllowList` — parsed entries: ``host`` (any port), ``host:port``,
  ``*.domain`` (any sub-domain of ``domain``, any port), ``*.domain:port``; IPv6 as
  ``[::1]`` or ``[::1]:8000``. Hosts compare case-insensitively; a URL's port defaults
  to 80 / 443 by scheme.
* :func:`judge_hosts_allowed` — a context in which every :class:`~scoring_workers.judge.
  client.JudgeClient` built checks its URLs (:func:`check_judge_url`); the worker
  builds its scorers inside it, so no scorer can reach a host outside the list.
* :func:`check_config_judge_hosts` — the same rule over a config's scorer ``kwargs``
  without building anything (every ``http(s)://`` string in them), for the CLI's
  checks before it connects to Kafka and Redis: one line naming the key.
* :func:`endpoint_label` — ``host:port`` of a URL: the only form of a judge URL that
  goes into a metric label (a URL's path, query or user info may carry a secret).
* :func:`redact_url` — ``scheme://host:port`` of a URL: the only form of a judge URL
  that goes into an error, a verdict reason or a log line, for the same reason.
* :func:`has_user_info` — whether a URL carries ``user:password@``.
* :func:`check_record_judge_urls` — credentials stay bound: a registry record's judge
  URL carries no user info (it would become an ``Authorization`` header of the record's
  choosing), and a record that names an operator profile holding credentials (a key,
  headers, a URL's user info) cannot send them anywhere but the profile's own URLs.

Pure standard library, no HTTP client: cheap to import from the CLI and the config checks.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from infra.config import ConfigError

__all__ = [
    "HostAllowList",
    "check_config_judge_hosts",
    "check_judge_url",
    "check_record_judge_urls",
    "config_judge_urls",
    "effective_allow_list",
    "endpoint_label",
    "has_user_info",
    "judge_hosts_allowed",
    "redact_url",
    "split_host_port",
]

SETTING = "worker.allowed_judge_hosts"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_RE = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")


def split_host_port(url: str) -> tuple[str, int]:
    """``(host, port)`` of an ``http(s)://`` URL; the host lower-cased, IPv6 in brackets.

    Raises:
        ValueError: not an http(s) URL with a host, or a malformed port.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        shown = f"'{parts.scheme}://{parts.hostname}'" if parts.scheme and parts.hostname else "the judge URL"
        raise ConfigError(f"{shown} is not an http(s) URL with a host")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"judge URL '{scheme}://{parts.hostname}' has a malformed port") from None
    host = parts.hostname.lower().rstrip(".")
    if ":" in host:
        host = f"[{host}]"
    return host, port if port is not None else _DEFAULT_PORTS[scheme]


def endpoint_label(url: str) -> str:
    """``host:port`` of a judge URL — what metrics and logs of the pool name it by."""
    try:
        host, port = split_host_port(url)
    except ValueError:
        return "invalid"
    return f"{host}:{port}"


def redact_url(url: str) -> str:
    """``scheme://host:port`` of ``url`` and nothing else — no user info, path, query or
    fragment, any of which may carry a credential — the one way a judge URL is rendered
    in errors, verdict reasons and logs (the port is explicit, its default filled in).
    Text that is not an http(s) URL with a host renders as ``<not an http(s) URL>``."""
    try:
        host, port = split_host_port(url)
    except ValueError:
        return "<not an http(s) URL>"
    return f"{urlsplit(url).scheme.lower()}://{host}:{port}"


def has_user_info(url: str) -> bool:
    """Whether ``url`` carries user info (``user:password@host``)."""
    authority = url.partition("://")[2]
    for end in "/?#":
        authority = authority.partition(end)[0]
    return "@" in authority


CREDENTIAL_KWARGS = ("api_key", "api_key_env", "api_key_file", "headers")
"""Scorer arguments whose value travels with every judge request (a key, extra headers)."""


def _root(url: str) -> str:
    """A judge URL as the client uses it (``JudgeClient`` strips a trailing ``/`` and ``/v1``)."""
    return url.strip().rstrip("/").removesuffix("/v1")


def check_record_judge_urls(
    profile: Mapping[str, Any], record: Mapping[str, Any], where: str, error: type[ConfigError] = ConfigError
) -> None:
    """A registry record's judge URLs (every ``http(s)://`` string in its entry's kwargs,
    ``record``), checked against the operator ``profile``'s kwargs the entry names
    (``{}``: none): no URL with user info; and when the profile holds credentials
    (:data:`CREDENTIAL_KWARGS` set, or user info in one of its URLs), every URL must be
    one of the profile's own (the record may choose among them, not add to them).

    Raises:
        ``error``: one line naming the argument (the URL rendered by :func:`redact_url`).
    """
    held = [name for name in CREDENTIAL_KWARGS if profile.get(name)]
    own = {_root(url) for _, url in _urls(profile, "")}
    if any(has_user_info(url) for url in own):
        held.append("user info in its URLs")
    for key, url in _urls(record, f"{where}.kwargs"):
        if has_user_info(url):
            raise error(
                f"{key}: a record's judge URL may not carry user info ({redact_url(url)!r} with "
                "'user:password@'): credentials are the operator's, set in a profile"
            )
        if held and _root(url) not in own:
            raise error(
                f"{key}: {redact_url(url)!r} is not one of the profile's own judge URLs; the profile "
                f"holds credentials ({', '.join(held)}), which go only where the operator pointed them"
            )


@dataclass(frozen=True, slots=True)
class _Entry:
    host: str  # lower-case; "*.example.com" keeps its "*." prefix
    port: int | None  # None: any port

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.host.startswith("*."):
            return host.endswith(self.host[1:])  # ".example.com": a sub-domain, not the domain itself
        return host == self.host

    def __str__(self) -> str:
        return self.host if self.port is None else f"{self.host}:{self.port}"


def _parse_entry(raw: Any) -> _Entry:
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"{SETTING}: entries must be host names like 'judge' or 'judge:30000', got {raw!r}")
    text = raw.strip().lower()
    if "://" in text or "/" in text or "@" in text:
        raise ConfigError(f"{SETTING}: {raw!r} is not a host; write the host (and optionally :port), not a URL")
    port: int | None = None
    if text.startswith("["):  # [v6] or [v6]:port
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"{SETTING}: {raw!r}: unclosed '[' in an IPv6 host")
        host, rest = text[: close + 1], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"{SETTING}: {raw!r}: expected ':port' after the IPv6 host")
            port = _port(raw, rest[1:])
        return _Entry(host, port)
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host = text
    else:
        port = _port(raw, port_text)
    host = host.rstrip(".")
    if not _HOST_RE.match(host) or "*" in host[2:]:
        raise ConfigError(
            f"{SETTING}: {raw!r} is not a host name, an IP address or '*.domain' (a wildcard covers sub-domains only)"
        )
    return _Entry(host, port)


def _port(raw: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"{SETTING}: {raw!r}: the port must be a number between 1 and 65535")
    return int(text)


class HostAllowList:
    """The hosts judge requests may go to (see the module docstring for the syntax).

    Raises:
        ConfigError: an entry that is not a host pattern (a URL, a path, a bad port).
    """

    def __init__(self, entries: Iterable[str]) -> None:
        if isinstance(entries, str):
            raise ConfigError(f"{SETTING} must be a list of hosts, got the string {entries!r}")
        self.entries: tuple[_Entry, ...] = tuple(_parse_entry(e) for e in entries)

    def allows(self, url: str) -> bool:
        try:
            host, port = split_host_port(url)
        except ValueError:
            return False
        return any(e.matches(host, port) for e in self.entries)

    def __repr__(self) -> str:
        return f"HostAllowList({[str(e) for e in self.entries]!r})"

    def describe(self) -> str:
        return repr([str(e) for e in self.entries])


_ALLOWED: ContextVar[HostAllowList | None] = ContextVar("prm_allowed_judge_hosts", default=None)


@contextlib.contextmanager
def judge_hosts_allowed(allowed: HostAllowList | Sequence[str] | None) -> Iterator[None]:
    """Within this block every judge client built checks its URLs against ``allowed``
    (``None``: no check — the config file that names the URLs is the operator's)."""
    if allowed is not None and not isinstance(allowed, HostAllowList):
        allowed = HostAllowList(allowed)
    token = _ALLOWED.set(allowed)
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def check_judge_url(url: str, what: str = "judge URL") -> None:
    """Refuse ``url`` when the enclosing :func:`judge_hosts_allowed` list does not allow it.

    Raises:
        ConfigError: one line naming the host and the setting.
    """
    allowed = _ALLOWED.get()
    if allowed is not None and not allowed.allows(url):
        raise ConfigError(_refusal(what, url, allowed))


def _refusal(what: str, url: str, allowed: HostAllowList) -> str:
    return (
        f"{what} {redact_url(url)!r}: host {endpoint_label(url)!r} is not in {SETTING} {allowed.describe()}; "
        "add it there if the operator trusts it with trajectories"
    )


def _urls(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        if value.strip().lower().startswith(("http://", "https://")):
            yield where, value.strip()
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _urls(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _urls(item, f"{where}[{i}]")


def config_judge_urls(prm: Any, key: str = "rollout.agent.prm") -> list[tuple[str, str]]:
    """``(config key, url)`` of every ``http(s)://`` string in the scorer entries' ``kwargs``
    (whatever the argument is called: a scorer of your own is covered too)."""
    found: list[tuple[str, str]] = []
    for i, entry in enumerate(getattr(prm, "scorers", ()) or ()):
        kwargs = entry.get("kwargs") if isinstance(entry, Mapping) else getattr(entry, "kwargs", None)
        if kwargs:
            found.extend(_urls(kwargs, f"{key}.scorers[{i}].kwargs"))
    return found


def check_config_judge_hosts(
    prm: Any, allowed: Sequence[str] | HostAllowList | None, key: str = "rollout.agent.prm"
) -> None:
    """Every judge URL a config's scorers name must be allowed by ``allowed``: an explicit
    ``worker.allowed_judge_hosts`` (``None``: the file's own hosts, nothing to check), or
    the :func:`effective_allow_list` a registry record is held to.

    Raises:
        ConfigError: a malformed entry, or the first URL outside the list (one line).
    """
    if allowed is None:
        return
    hosts = allowed if isinstance(allowed, HostAllowList) else HostAllowList(allowed)
    for where, url in config_judge_urls(prm, key):
        if not hosts.allows(url):
            raise ConfigError(_refusal(f"{where}: judge URL", url, hosts))


def effective_allow_list(
    prm: Any, allowed: Sequence[str] | None, profiles: Mapping[str, Any] | None = None
) -> HostAllowList:
    """The hosts a judge URL from *outside* the config file (e.g. a registry record) may
    use: the explicit list, or by default exactly the ``host:port`` pairs the config
    file's scorers and scorer profiles (``worker.scorer_profiles``) name."""
    if allowed is not None:
        return HostAllowList(allowed)
    urls = config_judge_urls(prm) + config_judge_urls(SimpleNamespace(scorers=list((profiles or {}).values())))
    return HostAllowList(sorted({endpoint_label(url) for _, url in urls} - {"invalid"}))
