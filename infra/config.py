"""Typed configuration: one YAML file plus ``PRM_*`` environment overrides.

The file accepts AReaL's ``rollout:`` / ``actor:`` blocks unchanged next to our own
``kafka:``, ``redis:``, ``topics:``, ``worker:``, ``trainer:`` and ``local:`` sections.
An unknown key is an error with the closest valid key (:func:`check_keys`), with one
exception: AReaL's own keys (:mod:`infra.areal_keys`, and inside ``rollout:`` /
``rollout.agent:`` / ``actor:`` any key that is no near-miss of one we read) are
accepted and ignored, so a whole AReaL training config loads. The ``rollout.agent.prm``
block, its scorer entries and our sections are strict throughout. AReaL's Process
Rewards rules are enforced at load time by :func:`validate`, with messages that name
the offending key.

Environment overrides: ``PRM_<SECTION>_<FIELD>=value`` for our own sections, e.g.
``PRM_KAFKA_BOOTSTRAP=host:9092``, ``PRM_REDIS_URL=redis://host:6379/0``,
``PRM_WORKER_SCORER_TIMEOUT_S=30``. Values are parsed as YAML scalars.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import SplitResult, urlsplit

import msgspec
import yaml

from infra.areal_keys import AREAL_ACTOR_KEYS, AREAL_AGENT_KEYS, AREAL_ROLLOUT_KEYS, AREAL_TOP_LEVEL_KEYS
from infra.errors import ConfigError
from infra.experiments import DEFAULT_EXPERIMENT, check_experiment_id

# Shaping modes, their coefficients and the trainer recipes come from the one registry.
from infra.modes import (
    COEFFICIENT_DEFAULTS,
    COMBINED_MODES,
    JUDGE_SCORER,
    OPD_SCORER,
    RECIPES,
    SHAPING_MODES,
    check_coefficient,
    combined_mode,
    mode_info,
    shaping_mode,
)
from infra.ports import MAX_PORT, Port
from infra.types import Seconds, did_you_mean, validating

log = logging.getLogger(__name__)

# Declarative constraints, checked by msgspec when a file or the environment is loaded
# (the message names the key: "worker.concurrency: Expected `int` >= 1"; durations are
# infra.types.Seconds). Values set from Python skip them; validate_prm keeps hand checks for
# the PRM block, which the runner also receives built in code.
Positive = Annotated[int, msgspec.Meta(ge=1)]


PRM_ERROR_POLICIES = ("reject", "keep_original")


# --------------------------------------------------------------------------- PRM (AReaL names)
class PRMScorerConfig(msgspec.Struct, kw_only=False, forbid_unknown_fields=True):
    """One configured scorer: an import path ``module.Class`` built as ``cls(weight=, enabled=, **kwargs)``.

    ``profile`` (our extension, instead of ``path``) names an operator's scorer profile
    (``worker.scorer_profiles``): its path and kwargs, with this entry's kwargs laid on
    top. In a registry record it is the only way to use operator-only arguments
    (:mod:`scoring_workers.prm.capabilities`).
    """

    path: str = ""
    weight: float = 1.0
    enabled: bool = True
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    profile: str | None = None


def resolve_profile(
    entry: PRMScorerConfig,
    profiles: Mapping[str, PRMScorerConfig],
    where: str,
    *,
    error: type[ConfigError] | None = None,
) -> PRMScorerConfig:
    """The profile ``entry`` names (its path and operator kwargs), or ``entry`` itself when it
    names none. Raises ``error`` (default :class:`ConfigError`) for an unknown profile or an
    entry that gives both a path and a profile."""
    kind = error or ConfigError
    if entry.profile is None:
        return entry
    if entry.path:
        raise kind(f"{where}: give `path` or `profile`, not both (the profile names its scorer)")
    base = profiles.get(entry.profile)
    if base is None:
        match = did_you_mean(entry.profile, list(profiles))
        hint = (
            f"did you mean `{match}`?"
            if match
            else (f"the workers' profiles are {sorted(profiles)}" if profiles else "the workers' config declares none")
        )
        raise kind(f"{where}.profile: no scorer profile `{entry.profile}` in worker.scorer_profiles; {hint}")
    return base


def expand_profiles(
    prm: PRMConfig, profiles: Mapping[str, PRMScorerConfig], key: str = "rollout.agent.prm"
) -> PRMConfig:
    """The operator's own ``prm`` block with each ``profile`` entry replaced by the profile
    (its kwargs, this entry's on top; the entry's weight and enabled). No capability
    rules apply here: this is the operator's own file."""
    if not any(isinstance(s, PRMScorerConfig) and s.profile is not None for s in prm.scorers):
        return prm
    out: list[Any] = []
    for i, entry in enumerate(prm.scorers):
        if isinstance(entry, PRMScorerConfig) and entry.profile is not None:
            base = resolve_profile(entry, profiles, f"{key}.scorers[{i}]")
            entry = PRMScorerConfig(base.path, entry.weight, entry.enabled, {**base.kwargs, **entry.kwargs})
        out.append(entry)
    return msgspec.structs.replace(prm, scorers=out)


class PRMAdvantageShapingConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the trainer folds process rewards into advantages (AReaL's Process Rewards,
    "Advantage Shaping"; docs/compatibility.md links the source).

    Checked when built (from a file or in code) and immutable after: the mode is a
    registered shaping mode and every coefficient is finite and ``>= 0`` (AReaL checks
    all three whatever the mode), so the trainer never checks them again per batch.
    """

    mode: str = "additive"
    negative_scale: float = COEFFICIENT_DEFAULTS["negative_scale"]
    zero_penalty: float = COEFFICIENT_DEFAULTS["zero_penalty"]
    zero_eps: float = COEFFICIENT_DEFAULTS["zero_eps"]

    def __post_init__(self) -> None:
        key = "rollout.agent.prm.advantage_shaping"
        if self.mode not in SHAPING_MODES:
            raise ConfigError(f"{key}.mode must be one of {list(SHAPING_MODES)}, got {self.mode!r}")
        for name in COEFFICIENT_DEFAULTS:
            try:
                check_coefficient(f"{key}.{name}", getattr(self, name))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    def coefficients(self) -> tuple[float, ...]:
        """The values of the coefficients the mode's kernel takes, in the registry's order."""
        return tuple(float(getattr(self, name)) for name in shaping_mode(self.mode).coefficients)


class PRMConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``rollout.agent.prm``. ``scorers`` items may also be scorer instances (borrowed by
    the runner) or plain mappings when built in Python."""

    enabled: bool = True
    scorers: list[PRMScorerConfig] = msgspec.field(default_factory=list)
    advantage_shaping: PRMAdvantageShapingConfig = msgspec.field(default_factory=PRMAdvantageShapingConfig)
    error_policy: str = "reject"
    """What a scorer failure does to the session (AReaL's ``PRMConfig.error_policy``):
    ``reject`` fails it (its group is rejected); ``keep_original`` keeps the session
    unscored (its original token rewards, no scorer contributions, no PRM stats) and
    says so in the verdict."""

    def __post_init__(self) -> None:
        if self.error_policy not in PRM_ERROR_POLICIES:
            raise ConfigError(
                f"rollout.agent.prm.error_policy must be one of {list(PRM_ERROR_POLICIES)}, got {self.error_policy!r}"
            )

    @property
    def active(self) -> bool:
        """Scoring runs only when enabled with at least one scorer (AReaL's Process Rewards:
        "An empty scorer list or enabled: false disables proxy scoring")."""
        return bool(self.enabled and self.scorers)


class AgentConfig(msgspec.Struct, kw_only=True):
    chat_template_type: str = "concat"
    export_style: str = "concat"
    prm: PRMConfig = msgspec.field(default_factory=lambda: PRMConfig(enabled=False))


class RolloutConfig(msgspec.Struct, kw_only=True):
    version: Literal["v1", "v2"] = msgspec.field(default="v1", name="_version")
    api_url: str | None = None
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)


class ActorConfig(msgspec.Struct, kw_only=True):
    token_rewards_as_adv: bool = False
    mask_no_eos_with_zero: bool = False


# --------------------------------------------------------------------------- our sections
_URL_PASSWORD = re.compile(r"(//[^:/@]*:)[^@/]*@")


def _masked_repr(struct: msgspec.Struct, secret_fields: tuple[str, ...] = (), url_fields: tuple[str, ...] = ()) -> str:
    """``repr`` without secrets, so a config that ends up in a log line leaks nothing."""
    parts = []
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        if name in secret_fields and value:
            value = "***"
        elif name in url_fields and isinstance(value, str):
            value = _URL_PASSWORD.sub(r"\1***@", value)
        parts.append(f"{name}={value!r}")
    return f"{type(struct).__name__}({', '.join(parts)})"


class KafkaConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    bootstrap: str = "127.0.0.1:9092"
    client_id: str = "prm-pipeline"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    compression: Literal["zstd", "lz4", "gzip", "none"] = "zstd"
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 1_048_576
    # Producer batching delay. aiokafka's flush() waits it out, and a worker's verdict waits
    # it before it is sent, so every produce hop adds it to a verdict's latency; with 0 a
    # batch goes out at once and records still batch while a request is in flight.
    linger_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    request_timeout_ms: int = 30_000
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    # The defaults suit Apache Kafka; the embedded broker's workarounds are the local
    # stack's settings (infra.local.LOCAL_BROKER_CLIENT: `prm-pipeline up` prints them, the
    # demo and the test fixtures apply them), never defaults a real deployment inherits.
    #
    # A stopping group member sends LeaveGroup so its partitions move at once. Set false
    # for tansu 0.6 (the embedded broker): a LeaveGroup from the group's leader while a
    # rebalance is forming leaves the departed member as leader, so no member is ever
    # elected again and the group stalls for good. Without it, membership ends by session
    # expiry (session_timeout_ms later), a path tansu handles (docs/faults.md).
    leave_group_on_stop: bool = True
    # Commands wait this long for the broker at startup (a log line per attempt), then
    # exit with one line naming the address (infra.startup).
    startup_timeout_s: Seconds = 30.0
    # How long the broker may hold a consumer's fetch when no data is there. Apache Kafka
    # answers when data arrives, so a long wait (500, aiokafka's and Kafka's default) costs
    # no latency and saves idle polls. With fetch_min_wait_ms set the wait adapts
    # (infra.kafka.AdaptiveFetchWait): fetch_min_wait_ms after a fetch that brought
    # records, doubling with each empty one up to fetch_max_wait_ms — for a broker that
    # answers at about half the wait even when records come sooner (the embedded one: the
    # local stack sets 5 and 20), where the short wait is the latency floor under load and
    # the long one the cost of idling (docs/capacity.md). null: no adaptation.
    fetch_min_wait_ms: Positive | None = None
    fetch_max_wait_ms: Positive = 500

    def __repr__(self) -> str:
        return _masked_repr(self, secret_fields=("sasl_password",))


class RedisConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # One URL; with ``cluster: true`` also several comma-separated ones, nodes of one cluster
    # the client may start from (whichever answers first): redis_urls() below.
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False  # Redis Cluster: the URL names any node; keys carry {group_id} hash tags
    key_prefix: str = "prm"
    ttl_s: Positive = 86_400
    ssl_ca_certs: str | None = None
    startup_timeout_s: Seconds = 30.0  # as kafka.startup_timeout_s, for Redis

    def __repr__(self) -> str:
        return _masked_repr(self, url_fields=("url",))


def redis_urls(cfg: RedisConfig) -> list[SplitResult]:
    """The URLs ``redis.url`` names: one, or — with ``redis.cluster: true`` — several
    comma-separated nodes of one cluster, so a client can start while any of them is down
    (a failover, a rescheduled pod). Credentials, database, TLS and options are the first
    URL's; the others name a host and port, and may repeat the first one's scheme and
    credentials but not differ from them.

    Each URL is checked before any connection (:func:`_redis_url`), so a malformed one is
    a configuration error at once rather than 30 s of retries as if Redis were down.

    Raises:
        ConfigError: an empty or malformed entry, several URLs without ``redis.cluster``, or
            nodes that disagree on scheme or credentials.
    """
    raw = cfg.url.split(",")
    if not cfg.url.strip():
        raise ConfigError(f"redis.url is empty; expected {_REDIS_URL_FORM}")
    if any(not u.strip() for u in raw):
        raise ConfigError(f"redis.url: an empty entry in {len(raw)} comma-separated URLs")
    urls = [_redis_url(u.strip()) for u in raw]
    if len(urls) > 1 and not cfg.cluster:
        raise ConfigError(
            f"redis.url lists {len(urls)} URLs: several nodes are for Redis Cluster "
            "(redis.cluster: true); a standalone Redis has one URL"
        )
    first = urls[0]
    for i, u in enumerate(urls[1:], 2):
        if u.scheme != first.scheme or not u.hostname:
            raise ConfigError(f"redis.url: URL {i} must be {first.scheme}://host:port like the first one")
        if (u.username or u.password) and (u.username, u.password) != (first.username, first.password):
            raise ConfigError(
                f"redis.url: URL {i} has other credentials than the first one; the cluster "
                "client logs in to every node as the first URL says"
            )
    return urls


_REDIS_URL_FORM = "redis://host:port/db (rediss:// for TLS, unix:///path/to.sock for a socket)"
_REDIS_SCHEMES = ("redis", "rediss", "unix")


def _redis_url(text: str) -> SplitResult:
    """One ``redis.url`` entry, parsed: a known scheme, a host (a path for ``unix://``) and
    a numeric port if any. ``localhost:6379`` parses as scheme ``localhost``: refused
    with the form to use, never passed on to be shown as ``localhost://?6379``."""
    shown = _URL_PASSWORD.sub(r"\1***@", text)
    url = urlsplit(text)
    if "://" not in text or url.scheme not in _REDIS_SCHEMES:
        raise ConfigError(
            f"redis.url {shown!r} has no redis://, rediss:// or unix:// scheme; expected {_REDIS_URL_FORM}"
        )
    if url.scheme == "unix" and not url.path:
        raise ConfigError(f"redis.url {shown!r} names no socket path; expected unix:///path/to.sock")
    if url.scheme != "unix" and not url.hostname:
        raise ConfigError(f"redis.url {shown!r} names no host; expected {_REDIS_URL_FORM}")
    try:
        url.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError:
        raise ConfigError(f"redis.url {shown!r} has a malformed port; expected {_REDIS_URL_FORM}") from None
    return url


def bootstrap_servers(bootstrap: str) -> list[tuple[str, int]]:
    """``kafka.bootstrap`` as ``(host, port)`` pairs: comma-separated ``host:port`` entries
    (``[::1]:9092`` for IPv6). Checked before any connection, so ``localhost`` (no port), a
    URL or an empty value is a configuration error at once, not 30 s of retries as if the
    broker were down.

    Raises:
        ConfigError: an empty value or entry, a missing or malformed port, or a scheme.
    """
    form = "expected host:port (e.g. 127.0.0.1:9092), comma-separated for several brokers"
    if not bootstrap.strip():
        raise ConfigError(f"kafka.bootstrap is empty; {form}")
    servers = []
    for entry in (e.strip() for e in bootstrap.split(",")):
        if not entry:
            raise ConfigError(f"kafka.bootstrap {bootstrap!r}: an empty entry; {form}")
        if "://" in entry:
            raise ConfigError(f"kafka.bootstrap {entry!r} is a URL; {form}, without a scheme")
        host, colon, port = entry.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not colon or not host or ":" in host and not entry.startswith("["):
            raise ConfigError(f"kafka.bootstrap {entry!r} has no port; {form}")
        if not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
            raise ConfigError(f"kafka.bootstrap {entry!r}: the port must be a number from 1 to {MAX_PORT}; {form}")
        servers.append((host, int(port)))
    return servers


class TopicsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    trajectories: str = "prm.trajectories"
    verdicts: str = "prm.verdicts"
    dead_letters: str = "prm.dead-letters"
    experiments: str = "prm.experiments"  # the experiment registry (compacted; docs/fleet.md)
    # Judged turns of streamed sessions for online trainers (OpenClaw-RL's mode; docs/trainer.md),
    # written only by workers with worker.turn_samples on.
    turn_samples: str = "prm.turn-samples"
    partitions: Positive = 8
    replication_factor: Positive = 1
    retention_ms: int = 7 * 86_400_000


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    group_id: str = "prm-scoring-workers"
    concurrency: Positive = 32
    scorer_timeout_s: Seconds = 60.0
    group_timeout_s: Seconds = 600.0
    poll_max_records: Positive = 256
    # Routine offset commits at most this often (each is a broker request, however few
    # offsets it carries); a crash redelivers up to this much more work, deduplicated by
    # the ledger. Commits at a rebalance or at shutdown are never delayed.
    commit_interval_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.5
    drain_timeout_s: float = 30.0
    metrics_port: Port | None = None
    # Scorer classes may be imported only from these module prefixes (configs are code
    # execution otherwise; trajectory payloads never name code). Add your own package.
    allowed_scorer_modules: list[str] = msgspec.field(default_factory=lambda: ["scoring_workers.scorers"])
    # Judge hosts the workers may send trajectories to ("judge", "judge:30000", "*.judges.svc").
    # null: exactly the hosts this file's scorers name; a list: every judge URL must match
    # it, refused at start-up otherwise. docs/security.md, "Judge endpoints"
    allowed_judge_hosts: list[str] | None = None
    # Named scorer settings of the operator's own (docs/security.md, "Registry records"):
    # a registry record names one (`profile: NAME`) to use arguments only the operator may
    # set (API keys, tokenizers, chat templates, headers); it may tune record-settable ones.
    scorer_profiles: dict[str, PRMScorerConfig] = msgspec.field(default_factory=dict)
    # Dead letters keep at most this many bytes of the original record (a header says so).
    dead_letter_max_bytes: int = 1_048_576
    # Verdicts also carry each scorer's own weighted token rewards (BranchResult.channels),
    # which trainer.combined_mode needs; off by default (verdicts grow by one reward array
    # per scorer and turn, compact for uniform turns).
    keep_scorer_channels: bool = False
    # Finished groups are remembered this long (compact time-bucketed sets in Redis): a
    # duplicate or late member within it is acknowledged without work; beyond it, the
    # trainer's dedupe on (experiment_id, group_id, verdict_version) drops the group's second verdict.
    # Cover the longest redelivery delay (consumer lag after an outage). docs/architecture.md
    dedupe_window_s: float = 3600.0
    # Tuning (arq keeps the same knobs as worker settings). A record whose processing
    # fails this many times with a non-transient error is dead-lettered (outages are
    # retried for as long as they last and never count).
    max_attempts: Positive = 3
    # A decided group whose verdict is not out this long after the decision (its
    # publisher died, or Kafka refused the verdict) is re-published by a sweeper.
    republish_grace_s: Seconds = 5.0
    # How often the sweeper looks for overdue groups (jittered ±20 %), and how long it
    # leaves a group alone after failing on it (not an outage) so one broken group
    # cannot flood the log.
    sweep_interval_s: Seconds = 0.5
    sweep_backoff_s: Seconds = 30.0
    # Token bytes of scored members kept in memory for the verdict; beyond it the oldest
    # are evicted and read back from the trajectories topic (scoring_workers/tokens.py).
    token_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * 1024 * 1024
    # What a verdict carries of each scored member's tokens: ``inline`` its token turns
    # (the verdicts topic alone reproduces the batches), ``reference`` its record's
    # coordinates in the trajectories topic (readers read the turns from there:
    # infra/readback.py), ``auto`` inline when the verdict fits kafka.max_message_bytes
    # and by reference when it does not, decided per verdict (a group of long sessions
    # is never rejected for its size). docs/wire.md, "Token turns inline or by reference".
    verdict_tokens: Literal["auto", "inline", "reference"] = "auto"
    # Streamed sessions (docs/wire.md, "Streamed sessions"): one that receives no record
    # for this long is answered as a missing member (its group is rejected, session_idle)
    # and its parked turns expire; at most session_max_turns turns are parked per session.
    session_idle_s: Seconds = 600.0
    session_max_turns: Positive = 10_000
    # Publish every judged turn of a streamed session on topics.turn_samples, for online
    # trainers (OpenClaw-RL's mode; docs/trainer.md, "Online").
    turn_samples: bool = False


class TrainerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """The reference trainer's options; checked when built (recipe, combined mode and
    their compatibility, from the registry in :mod:`infra.modes`), immutable after."""

    group_id: str = "prm-trainer"
    batch_groups: Positive = 8
    device: Literal["auto", "cpu", "cuda"] = "auto"
    filter: str | None = None
    # OpenClaw-RL's exclusion policy: turns the judge scored 0 or that have no next
    # state get loss mask 0; a session with no effective turn keeps its first judged
    # turn that had a next state (at-least-one guarantee). See shaper/exclusion.py.
    exclude_neutral_turns: bool = False
    judge_scorer: str = JUDGE_SCORER  # scorer whose turn results / channel are the judge's
    # null, or a PRM + OPD combination (shaper.combined) used as the per-token process
    # signal; needs worker.keep_scorer_channels for the judge and OPD scorers' channels.
    combined_mode: str | None = None  # one of the registry's combined modes (infra.modes)
    opd_scorer: str = OPD_SCORER  # scorer whose channel is the OPD token signal
    # grpo (ours: outcome advantage + shaped process rewards) or openclaw_turns (OpenClaw-RL:
    # each judged turn a sample, advantage = judge score, upstream exclusion). shaper/openclaw_recipe.py
    recipe: Literal[RECIPES] = "grpo"  # type: ignore[valid-type]
    # OpenClaw-RL's OPD trains no turn without an accepted hint: mask them (opd_scorer's results)
    drop_unhinted_turns: bool = False
    # Bound of the verdict consumer's in-memory dedupe set ((experiment_id, group_id, verdict_version)
    # keys, oldest evicted first; ~180 B each). Duplicates older than this many groups
    # are caught only by a durable --dedupe-store. See docs/trainer.md.
    dedupe_max_seen: Positive = 1_000_000
    # Staleness bound (off: null): an accepted group whose oldest member's policy_version is
    # more than this many versions behind the trainer's current policy is dropped and counted
    # (pipeline/filter/stale). AReaL's max_head_offpolicyness. docs/trainer.md, "Staleness bound"
    max_policy_lag: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # The experiment this trainer learns from (docs/fleet.md): its verdicts are read from
    # prm.verdicts.<experiment> (the default experiment keeps prm.verdicts), and the
    # RewardClient-based integrations and the gateway publish to and wait on its topics.
    experiment: str = DEFAULT_EXPERIMENT
    # OpenClaw-RL's online mode (recipe openclaw_turns only): also train on the workers' online
    # turn samples (topics.turn_samples; workers with worker.turn_samples) as they arrive, before
    # their sessions end; verdict members whose turns went out as samples are not trained again.
    # docs/trainer.md, "Online mode"
    online_samples: bool = False

    def __post_init__(self) -> None:
        try:
            check_experiment_id(self.experiment)
        except ValueError as exc:
            raise ConfigError(f"trainer.experiment: {exc}") from None
        if self.online_samples and self.recipe != "openclaw_turns":
            raise ConfigError(
                f"trainer.online_samples trains each turn sample as its own group of one, which is "
                f"OpenClaw-RL's recipe: it needs trainer.recipe 'openclaw_turns', got {self.recipe!r}"
            )
        if self.recipe not in RECIPES:
            raise ConfigError(f"trainer.recipe must be one of {list(RECIPES)}, got {self.recipe!r}")
        combined = None
        if self.combined_mode is not None:
            try:
                combined = combined_mode(self.combined_mode)
            except ValueError:
                raise ConfigError(
                    f"trainer.combined_mode must be one of {list(COMBINED_MODES)} or null, got {self.combined_mode!r}"
                ) from None
        if self.exclude_neutral_turns and (
            self.recipe == "openclaw_turns" or (combined and combined.own_turn_selection)
        ):
            which = (
                f"trainer.recipe {self.recipe!r}"
                if self.recipe == "openclaw_turns"
                else f"trainer.combined_mode {self.combined_mode!r}"
            )
            raise ConfigError(
                f"{which} applies OpenClaw-RL's own turn selection; turn trainer.exclude_neutral_turns off"
            )
        if self.recipe != "grpo" and combined is not None:
            raise ConfigError(
                f"trainer.recipe {self.recipe!r} defines the whole advantage; it cannot be combined with "
                f"trainer.combined_mode {self.combined_mode!r} (use one of them)"
            )

    @property
    def consumer_group(self) -> str:
        """The verdict consumer's Kafka group: ``group_id`` for the default experiment,
        ``<group_id>.<experiment>`` otherwise, so trainers of different experiments never
        share a group (a trainer joining one experiment must not rebalance another's)."""
        return self.group_id if self.experiment == DEFAULT_EXPERIMENT else f"{self.group_id}.{self.experiment}"


class LocalConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    data_dir: str = ".prm-local"
    broker_binary: str | None = None
    redis_binary: str | None = None


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``prm-pipeline gateway``: the HTTP reward service (docs/integrations/gateway.md).

    Requests carry samples only; everything that decides what runs (scorers, topics,
    limits, tokenizer) is set here by the operator.
    """

    host: str = "127.0.0.1"  # all interfaces needs auth (or --allow-unauthenticated)
    port: Port = 8431
    tokenizer: str = "bytes"  # "bytes" (UTF-8 bytes as ids, no files) or a tokenizer.json path
    grouping: Literal["per_query", "per_request"] = "per_query"  # how text queries form GRPO groups
    process_reduction: Literal["mean", "sum", "last"] = "mean"  # token rewards -> the scalar in `rewards`
    verdict_timeout_s: Seconds = 150.0  # then 504 (OpenRLHF's client gives up at 180 s)
    max_body_bytes: Positive = 4 * 1024 * 1024  # 413 above
    max_items: Positive = 256  # queries or samples per request (400 above)
    max_in_flight: Positive = 1024  # requests being answered, all clients (429 above)
    max_in_flight_per_client: Positive = 64  # per client address (429 above)
    read_timeout_s: Seconds = 30.0  # a request body must arrive within this (408)
    # an idle keep-alive connection (none sent, or between requests) is closed after this; above the
    # clients' own pool expiry (aiohttp 15 s, httpx 5 s) so that a client never reuses one being closed
    keepalive_timeout_s: Seconds = 20.0
    max_connections_per_client: Positive = 256  # open connections per client address; one more: 429 and closed
    auth_tokens_env: str | None = None  # name of an env var holding bearer tokens (comma-separated)
    auth_tokens_file: str | None = None  # file with one bearer token per line (rotation: list both)
    tls_certfile: str | None = None  # serve HTTPS with this certificate chain ...
    tls_keyfile: str | None = None  # ... and its private key


class PipelineConfig(msgspec.Struct, kw_only=True):
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    topics: TopicsConfig = msgspec.field(default_factory=TopicsConfig)
    worker: WorkerConfig = msgspec.field(default_factory=WorkerConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    local: LocalConfig = msgspec.field(default_factory=LocalConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)

    @property
    def prm(self) -> PRMConfig:
        return self.rollout.agent.prm


_ENV_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "kafka": KafkaConfig,
    "redis": RedisConfig,
    "topics": TopicsConfig,
    "worker": WorkerConfig,
    "trainer": TrainerConfig,
    "local": LocalConfig,
    "gateway": GatewayConfig,
}


# --------------------------------------------------------------------------- key checks
def unknown_key_message(where: str, key: str, candidates: Iterable[str]) -> str:
    """``where: unknown key `x`; did you mean `y`?`` (or the valid keys when none is close)."""
    candidates = sorted(set(candidates))
    match = did_you_mean(key, candidates)
    hint = f"did you mean `{match}`?" if match else f"valid keys: {', '.join(candidates)}"
    return f"{where}: unknown key `{key}`; {hint}"


def _keys(struct: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(struct))


def _strict(data: Any, struct: type[msgspec.Struct], where: str) -> None:
    """Every key of the mapping ``data`` must be a field of ``struct``."""
    if not isinstance(data, Mapping):
        return  # a wrong type is msgspec's to report, with the key
    known = _keys(struct)
    for key in data:
        if key not in known:
            raise ConfigError(unknown_key_message(where, str(key), known))


def _areal_block(data: Any, struct: type[msgspec.Struct], areal: frozenset[str], where: str) -> None:
    """An AReaL-owned block: keys AReaL defines pass, and so does any other key unless it
    is a near-miss of a key we read here (a misspelt ``token_rewards_as_adv`` must not be
    silently ignored; a key of a newer AReaL must not break loading)."""
    if not isinstance(data, Mapping):
        return
    ours = _keys(struct)
    for key in data:
        name = str(key)
        if name in ours or name in areal:
            continue
        close = difflib.get_close_matches(name.lower(), sorted(ours), n=1, cutoff=0.75)
        close += [k for k in sorted(ours) if sorted(k) == sorted(name.lower())]  # `pmr` for `prm`
        if close:
            raise ConfigError(f"{where}: unknown key `{name}`; did you mean `{close[0]}`?")


def check_keys(raw: Mapping[str, Any]) -> None:
    """Refuse unknown keys anywhere in a config mapping, naming the closest valid one.

    The rule (README, "Configuration"): our sections, the ``rollout.agent.prm`` block and
    its scorer entries are strict; at the top level AReaL's own sections
    (:data:`~infra.areal_keys.AREAL_TOP_LEVEL_KEYS`) are accepted and ignored; inside
    ``rollout:`` / ``rollout.agent:`` / ``actor:`` see :func:`_areal_block`. A scorer's
    ``kwargs`` are checked against its constructor when the scorers are resolved
    (:func:`scoring_workers.prm.resolve.check_scorer_entries`), not here: that needs the
    scorer's module imported.
    """
    ours = _keys(PipelineConfig)
    for key in raw:
        if key not in ours and key not in AREAL_TOP_LEVEL_KEYS:
            match = did_you_mean(str(key), ours | AREAL_TOP_LEVEL_KEYS)
            hint = (
                f"did you mean `{match}`?"
                if match
                else f"prm-pipeline's sections are {', '.join(sorted(ours))}; AReaL's are accepted too"
            )
            raise ConfigError(f"unknown top-level key `{key}`; {hint}")
    for section, struct in _ENV_SECTIONS.items():
        _strict(raw.get(section), struct, section)
    rollout, actor = raw.get("rollout"), raw.get("actor")
    _areal_block(actor, ActorConfig, AREAL_ACTOR_KEYS, "actor")
    _areal_block(rollout, RolloutConfig, AREAL_ROLLOUT_KEYS, "rollout")
    agent = rollout.get("agent") if isinstance(rollout, Mapping) else None
    _areal_block(agent, AgentConfig, AREAL_AGENT_KEYS, "rollout.agent")
    prm = agent.get("prm") if isinstance(agent, Mapping) else None
    check_prm_keys(prm)


def check_prm_keys(prm: Any, where: str = "rollout.agent.prm") -> None:
    """The PRM block is AReaL's Process Rewards config, which we implement whole: strict."""
    _strict(prm, PRMConfig, where)
    if not isinstance(prm, Mapping):
        return
    _strict(prm.get("advantage_shaping"), PRMAdvantageShapingConfig, f"{where}.advantage_shaping")
    scorers = prm.get("scorers")
    if isinstance(scorers, list):
        for i, entry in enumerate(scorers):
            if isinstance(entry, Mapping):
                check_scorer_entry_keys(entry, f"{where}.scorers[{i}]")


def check_scorer_entry_keys(entry: Mapping[str, Any], where: str) -> None:
    """A scorer entry takes ``path``, ``weight``, ``enabled``, ``kwargs``; the scorer's own
    arguments belong under ``kwargs`` (a stray one is named as such)."""
    known = _keys(PRMScorerConfig)
    for key in entry:
        if key not in known:
            message = unknown_key_message(where, str(key), known)
            if did_you_mean(str(key), known) is None:
                message += " (a scorer's own arguments go under `kwargs`)"
            raise ConfigError(message)


# --------------------------------------------------------------------------- loading
def _accepts_str(section: type[msgspec.Struct], field: str) -> bool:
    """Whether ``section.field`` is a free-form string (``str`` or ``str | None``)."""
    info = next(f for f in msgspec.structs.fields(section) if f.encode_name == field)
    return info.type is str or (
        typing.get_origin(info.type) in (typing.Union, types.UnionType)
        and set(typing.get_args(info.type)) == {str, type(None)}
    )


def _empty(section: type[msgspec.Struct], field: str) -> str | None:
    """An empty ``PRM_*`` value: null (the default, unset) where the field takes null, else
    ``""`` for a string field, so that its own rule says what is missing
    (``kafka.bootstrap is empty``) rather than "Expected `str`, got `null`"."""
    info = next(f for f in msgspec.structs.fields(section) if f.encode_name == field)
    return "" if info.type is str else None


def apply_env_overrides(
    raw: dict[str, Any], environ: Mapping[str, str], sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """Fold ``PRM_<SECTION>_<FIELD>`` variables into the raw YAML mapping.

    ``sources``, when given, receives ``"$.<section>.<field>"`` -> the variable that set it,
    so that an error about that value can name the variable rather than a YAML key.
    """
    out = dict(raw)
    for name, value in sorted(environ.items()):
        if not name.startswith("PRM_"):
            continue
        rest = name[4:].lower()
        section = next((s for s in _ENV_SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue  # PRM_CONFIG, PRM_TEST_* and friends are not config fields
        field = rest[len(section) + 1 :]
        fields = {f.encode_name for f in msgspec.structs.fields(_ENV_SECTIONS[section])}
        if field not in fields:
            match = did_you_mean(field, fields)
            hint = f"did you mean `{match}`?" if match else f"known: {sorted(fields)}"
            raise ConfigError(f"{name}: section {section!r} has no field {field!r}; {hint}")
        sub = dict(out.get(section) or {})
        try:
            parsed = yaml.safe_load(value) if value != "" else _empty(_ENV_SECTIONS[section], field)
        except yaml.YAMLError:  # `[::1]:9092` is no YAML, but a string field takes it as written
            if not _accepts_str(_ENV_SECTIONS[section], field):
                raise ConfigError(f"{_env_shown(name, environ)}: not a valid value for {section}.{field}") from None
            parsed = value
        if parsed is not None and not isinstance(parsed, str) and _accepts_str(_ENV_SECTIONS[section], field):
            parsed = value  # a password "12345" or a group id "on" stays a string
        sub[field] = parsed
        out[section] = sub
        if sources is not None:
            sources[f"$.{section}.{field}"] = name
    return out


_SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|KEY", re.IGNORECASE)


def _env_shown(name: str, environ: Mapping[str, str]) -> str:
    """``NAME='value'`` for an error message, without secrets: a variable named like a secret
    is shown as ``***``, passwords inside URLs (``redis://user:pw@host``) as ``***`` too."""
    value = environ.get(name, "")
    shown = "***" if value and _SECRET_NAME.search(name) else _URL_PASSWORD.sub(r"\1***@", value)
    return f"{name}={shown!r}"


def _blamed(message: str, sources: Mapping[str, str], environ: Mapping[str, str]) -> str:
    """``message``, led by the environment variables that set a value it names (the value is
    refused, or a rule it takes part in is broken), so the reader fixes the right place."""
    named = [
        _env_shown(name, environ)
        for key, name in sources.items()
        if re.search(rf"(?<![\w.]){re.escape(key[2:])}\b", message)
    ]
    return f"{', '.join(named)}: {message}" if named else message


def config_from_mapping(raw: Mapping[str, Any], *, environ: Mapping[str, str] | None = None) -> PipelineConfig:
    """Build and validate a config from an already-parsed mapping (plus env overrides)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a mapping at the top level, got {type(raw).__name__}")
    check_keys(raw)  # before dropping empty sections: a misspelt empty one is a typo too
    # ``worker:`` with every key commented out parses as null: treat it as "all defaults".
    data = {k: v for k, v in raw.items() if v is not None}
    env = os.environ if environ is None else environ
    sources: dict[str, str] = {}
    data = apply_env_overrides(data, env, sources)
    known = _keys(PipelineConfig)
    data = {k: v for k, v in data.items() if k in known}  # AReaL's other sections: accepted, not ours
    with validating(root=PipelineConfig, error=lambda text: ConfigError(_blamed(text, sources, env))):
        cfg = msgspec.convert(data, PipelineConfig, strict=False)
    for name, profile in cfg.worker.scorer_profiles.items():
        if not profile.path or profile.profile is not None:
            raise ConfigError(
                f"worker.scorer_profiles.{name}: a profile names its scorer by `path` (not another profile)"
            )
    cfg.rollout.agent.prm = expand_profiles(cfg.prm, cfg.worker.scorer_profiles)
    try:
        validate(cfg)
    except ConfigError as exc:  # a rule broken by a value from the environment: name the variable
        blamed = _blamed(str(exc), sources, env)
        if blamed == str(exc):
            raise
        raise ConfigError(blamed) from None
    return cfg


def load_config(
    path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None
) -> PipelineConfig:
    """Load ``path`` (or ``$PRM_CONFIG``, or built-in defaults) and apply ``PRM_*`` overrides."""
    env = os.environ if environ is None else environ
    path = path or env.get("PRM_CONFIG")
    raw: Any = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} " + ("is a folder, not a file" if p.is_dir() else "does not exist")
            )
        try:  # utf-8-sig: a byte-order mark is not part of the first key
            raw = yaml.safe_load(p.read_text(encoding="utf-8-sig")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return config_from_mapping(raw, environ=env)


# --------------------------------------------------------------------------- rules
def validate_prm(prm: PRMConfig, key: str = "rollout.agent.prm") -> None:
    """Rules that concern the PRM block alone (also used by the runner). The shaping
    mode and coefficients were checked when ``advantage_shaping`` was built."""
    if not isinstance(prm.advantage_shaping, PRMAdvantageShapingConfig):
        raise ConfigError(
            f"{key}.advantage_shaping must be a PRMAdvantageShapingConfig, got {type(prm.advantage_shaping).__name__}"
        )
    for i, scorer in enumerate(prm.scorers):
        if isinstance(scorer, PRMScorerConfig):
            if not scorer.path and scorer.profile is None:
                raise ConfigError(f"{key}.scorers[{i}].path must be a non-empty import path (or name a `profile`)")
            if not math.isfinite(scorer.weight):
                raise ConfigError(f"{key}.scorers[{i}].weight must be finite, got {scorer.weight!r}")


def validate(cfg: PipelineConfig) -> None:
    """Enforce AReaL's Process Rewards configuration rules; raise :class:`ConfigError` naming the key."""
    rollout, agent, prm, actor = cfg.rollout, cfg.rollout.agent, cfg.prm, cfg.actor
    validate_prm(prm)
    mode = prm.advantage_shaping.mode
    if prm.active:
        if agent.export_style != "concat":
            raise ConfigError(
                f"rollout.agent.export_style must be 'concat' when PRM scorers are active "
                f"(individual export is not supported), got {agent.export_style!r}"
            )
        if agent.chat_template_type != "concat":
            raise ConfigError(
                f"rollout.agent.chat_template_type must be 'concat' when PRM scorers are active, "
                f"got {agent.chat_template_type!r}"
            )
        if rollout.api_url:
            raise ConfigError(
                "rollout.api_url (v2 external-model mode) cannot be combined with active PRM "
                "scorers: that path stores string-only responses without token-backed "
                "interactions; remove rollout.api_url or disable rollout.agent.prm"
            )
        if not actor.token_rewards_as_adv:
            raise ConfigError(
                "actor.token_rewards_as_adv must be true when PRM scorers are active "
                "(folding dense rewards into GAE is not specified)"
            )
    info = shaping_mode(mode)  # registered: checked when the struct was built
    if info.direct_advantages and not actor.token_rewards_as_adv:
        raise ConfigError(
            f"actor.token_rewards_as_adv must be true with advantage_shaping.mode {mode!r} "
            "(it shapes direct process advantages)"
        )
    if info.unit_interval and actor.mask_no_eos_with_zero:
        raise ConfigError(
            "actor.mask_no_eos_with_zero: true cannot be combined with "
            f"rollout.agent.prm.advantage_shaping.mode {mode!r}"
        )
    combined = cfg.trainer.combined_mode
    if combined is not None and info.unit_interval and combined_mode(combined).yields == "signal":
        raise ConfigError(
            f"trainer.combined_mode {combined!r} produces signed token signals, but "
            f"rollout.agent.prm.advantage_shaping.mode {mode!r} needs process rewards in [0, 1]; "
            f"use one of {[m for m in SHAPING_MODES if not mode_info(m).unit_interval]}"  # type: ignore[union-attr]
        )
    bootstrap_servers(cfg.kafka.bootstrap)
    redis_urls(cfg.redis)
