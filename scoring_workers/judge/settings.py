"""The judge's settings: frozen msgspec structs, typed and bounded with ``Meta`` constraints.

* :class:`ClientSettings` configures a :class:`~scoring_workers.judge.client.JudgeClient`;
  its parts are :class:`RequestSettings` (timeouts and retries of one logical request),
  :class:`LimitSettings` (an endpoint's process-wide limits, :mod:`~scoring_workers.judge.limits`),
  :class:`ConnectionSettings` (headers, credentials, proxies) and :class:`SpillPolicy`
  (a pool's routing, :mod:`~scoring_workers.judge.pool`).
* :class:`ModelSettings` configures a :class:`~scoring_workers.judge.apis.JudgeEndpoint`
  and the API adapters: which API, which model, its sampling, how its answer is read.

Every struct checks its types and bounds however it is built: from configuration data
(:func:`from_values`: one :class:`ValueError` naming the field) or in code (a direct
``RequestSettings(timeout_s=0)`` raises the same way). Scorers keep their flat keyword
arguments (users' YAML) and build the structs from them (:meth:`ClientSettings.from_flat`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from infra.config import ConfigError
from infra.types import Delay, Seconds, validating

__all__ = [
    "ClientSettings",
    "ConnectionSettings",
    "JudgeApi",
    "JudgeQuota",
    "LimitSettings",
    "ModelSettings",
    "RequestSettings",
    "Settings",
    "SpillPolicy",
    "from_values",
]

JudgeApi = Literal["openai", "sglang"]

_Large = Annotated[int, Meta(ge=1, le=1_000_000_000)]

S = TypeVar("S", bound="Settings")
_CONVERTING: ContextVar[bool] = ContextVar("prm_judge_settings_converting", default=False)


class Settings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of the judge's settings structs: checked on construction, whichever way.

    msgspec checks ``Meta`` bounds when it converts data, not when a struct is built in
    code; ``__post_init__`` closes that gap by converting a directly built struct once
    more, then runs :meth:`_check` (the rules that span fields). A subclass says
    ``frozen=True`` again: msgspec inherits it, but a type checker reads each class's own.
    """

    def __post_init__(self) -> None:
        if not _CONVERTING.get():  # built in code: check the types and bounds too
            token = _CONVERTING.set(True)
            try:
                with validating(type(self).__name__, root=type(self)):
                    msgspec.convert(msgspec.to_builtins(self), type(self), strict=True)
            finally:
                _CONVERTING.reset(token)
        self._check()

    def _check(self) -> None:
        """Rules over several fields (raise :class:`ValueError`)."""


def from_values(cls: type[S], values: Mapping[str, Any], where: str = "") -> S:
    """``cls`` from configuration values (missing ones take the defaults), checked.

    Raises:
        ValueError: one line: ``where``, then what is wrong and with which field.
    """
    token = _CONVERTING.set(True)
    try:
        with validating(root=cls, error=lambda text: ConfigError(f"{where}: {text}" if where else text)):
            return msgspec.convert(dict(values), cls, strict=True)
    finally:
        _CONVERTING.reset(token)


# --------------------------------------------------------------------------- the client
class RequestSettings(Settings, frozen=True):
    """One logical request (:meth:`~scoring_workers.judge.client.JudgeClient.post_json`).

    ``timeout_s`` bounds one HTTP attempt, ``total_timeout_s`` the request with its
    retries; ``max_retries`` retries follow a connect error, a 5xx or a 429 (also a
    timeout with ``retry_on_timeout``); the backoff before retry ``k`` is drawn from
    ``[d/2, d]``, ``d = min(backoff_max_s, backoff_base_s * 2**(k-1))`` (:class:`infra.retry.RetryPolicy`).
    """

    timeout_s: Seconds = 30.0
    total_timeout_s: Seconds = 45.0
    max_retries: Annotated[int, Meta(ge=0, le=1000)] = 2
    backoff_base_s: Delay = 0.2
    backoff_max_s: Delay = 5.0
    retry_on_timeout: bool = False

    def _check(self) -> None:
        if self.backoff_base_s > self.backoff_max_s:
            raise ConfigError(
                f"backoff_base_s ({self.backoff_base_s}) must not exceed backoff_max_s "
                f"({self.backoff_max_s}): the first pause is the smallest"
            )


class LimitSettings(Settings, frozen=True):
    """The process-wide limits of one judge endpoint, shared by every client of it in the
    process (:mod:`~scoring_workers.judge.limits`). ``None`` inherits what is registered
    (or the defaults, :data:`~scoring_workers.judge.limits.DEFAULT_LIMITS`); ``rps=0``
    means no pacing."""

    max_concurrency: _Large | None = None
    rps: Annotated[float, Meta(ge=0, le=1_000_000_000)] | None = None
    breaker_failure_threshold: _Large | None = None
    breaker_reset_s: Seconds | None = None


class ConnectionSettings(Settings, frozen=True):
    """What every request carries and how it travels.

    ``headers``: extra request headers. ``api_key_env`` (an environment variable),
    ``api_key_file`` (a file, e.g. a mounted Kubernetes Secret; surrounding white space
    stripped) or ``api_key`` add ``Authorization: Bearer ...``, the first one set
    winning. ``trust_env``: read proxy settings from the environment (off: judges are
    cluster-internal and a stray ``HTTP_PROXY`` breaks them).
    """

    headers: dict[str, str] = {}
    api_key: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    trust_env: bool = False

    def __repr__(self) -> str:  # never print a key
        key = None if self.api_key is None else "<redacted>"
        return (
            f"ConnectionSettings(headers={sorted(self.headers)!r}, api_key={key}, "
            f"api_key_env={self.api_key_env!r}, api_key_file={self.api_key_file!r}, trust_env={self.trust_env})"
        )


class SpillPolicy(Settings, frozen=True):
    """When a session's preferred endpoint of a pool counts as overloaded
    (:mod:`~scoring_workers.judge.pool`, rule 3).

    ``spill_in_flight``: how many more unfinished calls than the least-loaded endpoint
    it must have; ``spill_ratio``: and how many times as many. Defaults 16 (half the
    default per-endpoint concurrency cap of 32) and 1.5 (SGLang's router's relative
    threshold): a replica serving a few more of its sessions' calls than the others
    keeps them (cache hits are worth a short queue); one that has fallen behind sheds
    the excess. Loads are counted per worker process, so the thresholds are too.
    """

    spill_in_flight: Annotated[int, Meta(ge=0, le=1_000_000_000)] = 16
    spill_ratio: Annotated[float, Meta(ge=1, le=1_000_000)] = 1.5


class ClientSettings(Settings, frozen=True):
    """Everything a :class:`~scoring_workers.judge.client.JudgeClient` is configured by."""

    request: RequestSettings = RequestSettings()
    limits: LimitSettings = LimitSettings()
    connection: ConnectionSettings = ConnectionSettings()
    spill: SpillPolicy = SpillPolicy()

    @classmethod
    def parts(cls) -> tuple[type[Settings], ...]:
        """The structs its fields hold: request, limits, connection, spill."""
        return tuple(_PARTS.values())

    @classmethod
    def flat_fields(cls) -> frozenset[str]:
        """The names :meth:`from_flat` takes: every field of every part."""
        return frozenset(name for part in _PARTS.values() for name in part.__struct_fields__)

    @classmethod
    def from_flat(cls, values: Mapping[str, Any], where: str = "") -> ClientSettings:
        """The settings from flat keyword values (a scorer's kwargs: ``timeout_s``,
        ``max_concurrency``, ``headers``, ``spill_ratio``...: :meth:`flat_fields`); an
        unknown name or a value outside its bounds is a :class:`ValueError` naming it.
        Header names and values are taken as text (YAML may read ``X-Priority: 1`` as a
        number); ``headers: None`` means none."""
        unknown = sorted(set(values) - cls.flat_fields())
        if unknown:
            raise ConfigError(f"{where + ': ' if where else ''}no judge client setting {', '.join(unknown)}")
        values = dict(values)
        headers = values.pop("headers", None)
        if isinstance(headers, Mapping):
            values["headers"] = {str(k): str(v) for k, v in headers.items()}
        elif headers is not None:
            values["headers"] = headers  # refused by the type check, with the field named

        def part(part: type[S]) -> S:
            return from_values(part, {k: v for k, v in values.items() if k in part.__struct_fields__}, where)

        return cls(
            request=part(RequestSettings),
            limits=part(LimitSettings),
            connection=part(ConnectionSettings),
            spill=part(SpillPolicy),
        )


_PARTS: dict[str, type[Settings]] = {
    "request": RequestSettings,
    "limits": LimitSettings,
    "connection": ConnectionSettings,
    "spill": SpillPolicy,
}


class JudgeQuota(Settings, frozen=True, kw_only=False):
    """One experiment's share of every judge endpoint it calls (:func:`~scoring_workers.
    judge.limits.judge_quota`).

    ``scope``: the experiment id (a metric label: keep the set of scopes bounded).
    ``max_in_flight``: its attempts in flight per endpoint (``None``: no cap);
    ``rps``: its attempts per second per endpoint (``None``: unpaced). The process-wide
    limits of each endpoint apply on top.
    """

    scope: Annotated[str, Meta(pattern=r"\S")]
    max_in_flight: _Large | None = None
    rps: Annotated[float, Meta(gt=0, le=1_000_000_000)] | None = None

    @property
    def unlimited(self) -> bool:
        return self.max_in_flight is None and self.rps is None


# --------------------------------------------------------------------------- the model
class ModelSettings(Settings, frozen=True):
    """What a judge call asks for and how its answer is read (:mod:`~scoring_workers.judge.apis`).

    ``api``: ``openai`` (``/v1/chat/completions``; the server applies its chat
    template) or ``sglang`` (``/generate`` on a rendered prompt). ``top_p`` / ``top_k``
    are sent unless ``None`` (``top_k=-1``: off; OpenAI's own API refuses ``top_k``)
    and, with ``include_reasoning``, the reasoning a server split off is read before the
    content — all three for ``api="openai"``: SGLang always gets OpenClaw-RL's ``top_p =
    1``, ``top_k = -1`` and is parsed raw, thinking included.
    """

    api: JudgeApi = "openai"
    model: Annotated[str, Meta(min_length=1)] = "default"
    temperature: Annotated[float, Meta(ge=0, le=1_000)] = 0.6
    max_tokens: _Large = 4096
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = 1.0
    top_k: Annotated[int, Meta(ge=-1)] | None = -1
    include_reasoning: bool = True

    def _check(self) -> None:
        if self.top_k == 0:
            raise ConfigError("top_k must be -1 (off), an integer >= 1, or null (not sent), got 0")
