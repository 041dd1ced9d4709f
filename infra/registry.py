"""The experiment registry: declared experiments, as records of a compacted Kafka topic.

An experiment is declared by an operator (``prm-pipeline experiment add FILE.yaml``)
as one record of ``topics.experiments`` (``prm.experiments``): key = the experiment
id, value = the :class:`ExperimentSpec` as JSON; removing it writes ``{"removed": SPEC}``,
a removal that keeps the last declaration: the experiment's topics stay readable and
auditable (``verdicts``, ``inspect``, ``audit`` and ``dead-letters`` read them and say it
is removed; ``audit`` re-scores with that declaration). A tombstone (no value) is a
removal that kept nothing (what earlier versions wrote). Every worker reads the topic
from its beginning and keeps following it, so the latest record per key is the
experiment's current declaration — the topic is the source of truth, replayable like
the others, and compaction keeps it small.

Why JSON and not msgpack like the trajectory records: these are a handful of small
operator-written documents; a person reading the topic (``kafka-console-consumer``,
``experiment list --json``) should see them as written.

A record is *data about code*: it names scorer classes and judge URLs. It is checked
twice, and neither check trusts it:

1. here, as data — :func:`decode_record`: the key and the declared id agree, the schema
   holds (unknown keys are errors, with the closest valid key), sizes and quotas are in
   range. A malformed record is refused with one line and never stops a reader;
2. on the worker, as code — the scorer modules must pass the worker's own
   ``worker.allowed_scorer_modules`` and every judge URL its ``worker.allowed_judge_hosts``
   (:mod:`scoring_workers.fleet`), both set by the operator on the worker, never by the
   record.

Only the operators' principal may write the topic (Kafka ACLs, docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml
from aiokafka.structs import TopicPartition

from infra import aiokafka_internals
from infra.bounded_json import JSONBoundsError, decode_json
from infra.config import ConfigError, PipelineConfig, PRMConfig, check_prm_keys, unknown_key_message, validate_prm
from infra.experiments import DEFAULT_EXPERIMENT, UnknownExperiment, check_experiment_id
from infra.kafka import check_size, ensure_topics, make_consumer, make_producer
from infra.types import validating

log = logging.getLogger(__name__)

__all__ = [
    "KIND",
    "MAX_RECORD_BYTES",
    "ExperimentSpec",
    "JudgeQuotaSpec",
    "RegistryError",
    "RegistryFollower",
    "RecordedExperiment",
    "RegistryRecord",
    "declared_experiment",
    "decode_entry",
    "decode_record",
    "encode_spec",
    "load_spec_file",
    "publish_removal",
    "recorded_experiment",
    "removed_note",
    "publish_spec",
    "read_registry",
]

KIND = "experiment"
"""The ``prm-kind`` header of a registry record."""
IDLE_FETCH_WAIT_MS = 500
"""The longest a worker's registry reader waits per fetch: a declaration takes effect within
about this long (plus the worker's next registry step), and an idle registry costs two
requests a second."""
MAX_RECORD_BYTES = 65_536
"""A registry record is a small document: anything larger is refused, whatever the broker allows."""
MAX_RECORD_DEPTH = 16
"""A record nests at most 6 levels (spec, prm, scorers, entry, kwargs, a list value): deeper is refused."""

# A record is untrusted: its bounds are tighter than the worker config's (a group timeout of at
# most a week, not infra.types.Seconds's any finite duration).
_Weight = Annotated[float, msgspec.Meta(gt=0, le=1000)]
_Slots = Annotated[int, msgspec.Meta(ge=1, le=100_000)]
# a record's rates and durations have floors: below them they are not tuning but a failure of every call
_Rate = Annotated[float, msgspec.Meta(ge=0.01, le=100_000)]
_Timeout = Annotated[float, msgspec.Meta(ge=1, le=7 * 86_400)]


class RegistryError(ConfigError):
    """A registry record (or experiment file) that cannot take effect; the message says why."""


class JudgeQuotaSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What one experiment may ask of each judge endpoint (on top of the process-wide limits)."""

    max_in_flight: _Slots | None = None
    """Judge calls of this experiment in flight per endpoint, per worker process."""
    rps: _Rate | None = None
    """Judge calls per second of this experiment per endpoint, per worker process."""


class ExperimentSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One experiment, as declared in the registry (the YAML file of ``experiment add``).

    ``prm`` is the same block as a worker config's ``rollout.agent.prm``: the scorer
    stack (paths must pass the worker's ``worker.allowed_scorer_modules``), the
    advantage-shaping settings and the error policy. Everything else has the worker's
    default when left out.
    """

    experiment_id: str
    prm: PRMConfig
    weight: _Weight = 1.0
    """Share of a worker's in-flight slots relative to the other busy experiments."""
    max_in_flight: _Slots | None = None
    """At most this many of the experiment's records in flight per worker (its quota)."""
    group_timeout_s: _Timeout | None = None
    """A group still incomplete this long after its first member is rejected (default: the worker's)."""
    judge_quota: JudgeQuotaSpec | None = None
    description: str = ""

    def __post_init__(self) -> None:
        check_experiment_id(self.experiment_id)
        if self.experiment_id == DEFAULT_EXPERIMENT:
            raise RegistryError(
                f"experiment {DEFAULT_EXPERIMENT!r} is the workers' own config file's; declare another id"
            )
        if len(self.description) > 2000:
            raise RegistryError("description is longer than 2000 characters")


@dataclass(frozen=True, slots=True)
class RegistryRecord:
    """One record of the registry topic, decoded: a declaration (``spec``), a removal
    (``spec is None`` and no ``error``; ``kept``: the declaration it keeps for reading and
    auditing the experiment's topics, None for a bare tombstone), or a refused record
    (``error`` says why)."""

    experiment_id: str
    spec: ExperimentSpec | None
    offset: int
    error: str = ""
    timestamp_ms: int = 0
    kept: ExperimentSpec | None = None

    @property
    def removal(self) -> bool:
        return self.spec is None and not self.error


_ENCODER = msgspec.json.Encoder()


def encode_spec(spec: ExperimentSpec) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """``(key, value, headers)`` of the registry record declaring ``spec``."""
    value = _ENCODER.encode(spec)
    if len(value) > MAX_RECORD_BYTES:
        raise RegistryError(
            f"experiment {spec.experiment_id!r}: the record is {len(value)} bytes, over the "
            f"registry's limit of {MAX_RECORD_BYTES}"
        )
    return spec.experiment_id.encode(), value, [("prm-kind", KIND.encode()), ("prm-schema-version", b"1")]


def _spec_from_mapping(data: Any, where: str) -> ExperimentSpec:
    if not isinstance(data, dict):
        raise RegistryError(f"{where}: an experiment must be a mapping, got {type(data).__name__}")
    known = {f.encode_name for f in msgspec.structs.fields(ExperimentSpec)}
    for key in data:
        if key not in known:
            raise RegistryError(unknown_key_message(where, str(key), known))
    try:
        if isinstance(data.get("prm"), dict):  # keys relative to the file: the file is named once, below
            check_prm_keys(data["prm"], "prm")
        with validating(root=ExperimentSpec, error=lambda text: RegistryError(f"{where}: {text}")):
            spec = msgspec.convert(data, ExperimentSpec, strict=False)
        validate_prm(spec.prm, "prm")
    except RegistryError:
        raise
    except (ValueError, TypeError) as exc:
        raise RegistryError(f"{where}: {exc}") from None
    if not spec.prm.active:
        raise RegistryError(f"{where}: prm has no enabled scorer; an experiment needs at least one")
    return spec


_REMOVED = "removed"
"""The one key of a removal record's value: ``{"removed": SPEC}``."""


def encode_removal(spec: ExperimentSpec) -> bytes:
    """The value of the registry record removing ``spec``'s experiment while keeping its declaration."""
    value = _ENCODER.encode({_REMOVED: spec})
    if len(value) > MAX_RECORD_BYTES:
        raise RegistryError(
            f"experiment {spec.experiment_id!r}: the removal record is {len(value)} bytes, over "
            f"the registry's limit of {MAX_RECORD_BYTES}"
        )
    return value


def decode_record(key: bytes | None, value: bytes | None) -> ExperimentSpec | None:
    """The declaration a registry record holds (``None``: a removal).

    Raises:
        RegistryError: a key that is not an experiment id, a value too large, not JSON,
            not an experiment, or declaring another id than its key.
    """
    return decode_entry(key, value)[0]


def decode_entry(key: bytes | None, value: bytes | None) -> tuple[ExperimentSpec | None, ExperimentSpec | None]:
    """``(declaration, kept)`` of a registry record: ``(spec, None)`` for a declaration,
    ``(None, spec)`` for a removal keeping its last declaration, ``(None, None)`` for a tombstone.

    Raises:
        RegistryError: as :func:`decode_record`.
    """
    try:
        experiment_id = check_experiment_id((key or b"").decode("utf-8", "strict"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RegistryError(f"registry record key: {exc}") from None
    if value is None:
        return None, None
    if len(value) > MAX_RECORD_BYTES:
        raise RegistryError(
            f"experiment {experiment_id!r}: record of {len(value)} bytes, over the limit of {MAX_RECORD_BYTES}"
        )
    try:  # bounded: a record nested 30,000 deep is refused here, not a RecursionError in a worker
        data: Any = decode_json(
            value,
            what=f"experiment {experiment_id!r}: the record",
            max_bytes=MAX_RECORD_BYTES,
            max_depth=MAX_RECORD_DEPTH,
        )
    except JSONBoundsError as exc:
        raise RegistryError(str(exc)) from None
    removal = isinstance(data, dict) and list(data) == [_REMOVED]
    where = f"experiment {experiment_id!r}" + (" (removal)" if removal else "")
    spec = _spec_from_mapping(data[_REMOVED] if removal else data, where)
    if spec.experiment_id != experiment_id:
        raise RegistryError(
            f"{where}: the record declares {spec.experiment_id!r}; the key and experiment_id must agree"
        )
    return (None, spec) if removal else (spec, None)


def load_spec_file(path: str | Path) -> ExperimentSpec:
    """An experiment declared in a YAML file (the argument of ``experiment add``)."""
    p = Path(path)
    if not p.is_file():
        raise RegistryError(
            f"experiment file {str(p)!r} " + ("is a folder, not a file" if p.is_dir() else "does not exist")
        )
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8-sig"))
    except yaml.YAMLError as exc:
        raise RegistryError(f"{p}: not valid YAML: {exc}") from None
    spec = _spec_from_mapping(data, str(p))
    encode_spec(spec)  # the size limit, before anything is sent
    return spec


# --------------------------------------------------------------------------- writing
async def _send(cfg: PipelineConfig, key: bytes, value: bytes | None, headers: Sequence[tuple[str, bytes]]) -> int:
    # The registry's topic, made as it must be (one partition, compacted) when it is not
    # there yet: a send never has the broker create it (no client of ours asks it to).
    await ensure_topics(cfg.kafka, cfg.topics, [cfg.topics.experiments])
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        if value is not None:
            check_size(value, cfg.kafka, "registry record", key, headers)
        meta = await producer.send_and_wait(cfg.topics.experiments, value, key=key, headers=list(headers))
        return int(meta.offset)
    finally:
        await producer.stop()


async def publish_spec(cfg: PipelineConfig, spec: ExperimentSpec) -> int:
    """Declare (or replace) ``spec`` in the registry; returns the record's offset."""
    key, value, headers = encode_spec(spec)
    return await _send(cfg, key, value, headers)


async def publish_removal(cfg: PipelineConfig, experiment_id: str, keep: ExperimentSpec | None = None) -> int:
    """Remove ``experiment_id`` from the registry; returns the record's offset.

    ``keep``: its last declaration, kept in the removal record so that ``audit`` can still
    re-score its topics; None writes a tombstone (nothing to keep: its latest record was refused).
    """
    check_experiment_id(experiment_id)
    value = None if keep is None else encode_removal(keep)
    return await _send(cfg, experiment_id.encode(), value, [("prm-kind", KIND.encode()), ("prm-schema-version", b"1")])


# --------------------------------------------------------------------------- reading
class RegistryFollower:
    """Reads the registry topic from its beginning and keeps following it.

    :meth:`catch_up` returns every record up to the end of the topic as it was when
    called (a worker applies them before it consumes trajectories, so a record of a
    declared experiment is never taken for an unknown one); :meth:`poll` returns what
    arrived since. A refused record comes back with its ``error`` — the reader goes on.
    A registry topic that does not exist yet is "no experiments", looked for again on
    every poll.
    """

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.topic = cfg.topics.experiments
        # The registry changes rarely: idle, its fetches back off to IDLE_FETCH_WAIT_MS (a worker
        # must not pay a request every 20 ms for it), and a burst of records is read at once.
        self._consumer = make_consumer(
            cfg.kafka,
            group_id=None,
            enable_auto_commit=False,
            fetch_max_wait_ms=max(IDLE_FETCH_WAIT_MS, cfg.kafka.fetch_max_wait_ms),
        )
        self._assigned: list[TopicPartition] = []
        self._started = False
        self._next_look = 0.0

    async def start(self) -> None:
        await self._consumer.start()
        self._started = True

    async def _assign(self) -> bool:
        if self._assigned:
            return True
        if time.monotonic() < self._next_look:
            return False
        self._next_look = time.monotonic() + 5.0
        await aiokafka_internals.refresh_metadata(self._consumer)
        partitions = self._consumer.partitions_for_topic(self.topic)
        if not partitions:
            return False
        self._assigned = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(self._assigned)
        await self._consumer.seek_to_beginning(*self._assigned)
        log.info("following the experiment registry %s (%d partitions)", self.topic, len(self._assigned))
        return True

    async def catch_up(self, timeout_s: float = 30.0) -> list[RegistryRecord]:
        """Every record up to the topic's end (as of now); empty if the topic does not exist."""
        if not await self._assign():
            return []
        out: list[RegistryRecord] = []
        deadline = time.monotonic() + timeout_s
        while not await self._at_end():  # the end is the fetch's high watermark (end_offsets is
            if time.monotonic() > deadline:  # wrong on the embedded broker)
                raise TimeoutError(f"could not read the registry {self.topic} to its end in {timeout_s:g}s")
            out += await self.poll(timeout_ms=100)
        return out

    async def _at_end(self) -> bool:
        for tp in self._assigned:
            high = self._consumer.highwater(tp)
            if high is None or await self._consumer.position(tp) < high:
                return False
        return True

    async def poll(self, timeout_ms: int = 0) -> list[RegistryRecord]:
        """The records that arrived since the last call (waits up to ``timeout_ms``)."""
        if not await self._assign():
            if timeout_ms:
                await asyncio.sleep(timeout_ms / 1000)
            return []
        batch = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=500)
        return [self._decode(r) for records in batch.values() for r in records]

    @staticmethod
    def _decode(record: Any) -> RegistryRecord:
        """One record, decoded on its own: whatever it holds refuses *it* (with the reason) and
        never its neighbours in the same fetch, nor the reader."""
        name = (record.key or b"").decode("utf-8", "replace")[:80]
        try:
            spec, kept = decode_entry(record.key, record.value)
        except RegistryError as exc:
            return RegistryRecord(name, None, record.offset, error=str(exc), timestamp_ms=record.timestamp)
        except Exception as exc:
            log.exception("experiment registry: record %r at offset %d could not be decoded", name, record.offset)
            return RegistryRecord(
                name,
                None,
                record.offset,
                error=f"undecodable record ({type(exc).__name__}: {str(exc)[:200]})",
                timestamp_ms=record.timestamp,
            )
        return RegistryRecord(name, spec, record.offset, timestamp_ms=record.timestamp, kept=kept)

    async def aclose(self) -> None:
        if self._started:
            await self._consumer.stop()
            self._started = False


async def read_registry(cfg: PipelineConfig, *, removed: bool = False) -> dict[str, RegistryRecord]:
    """The registry as it stands: the latest record of each experiment still declared
    (a refused latest record is kept, with its error, so ``experiment list`` shows it);
    with ``removed``, also the removal of each removed experiment (``kept``: its declaration)."""
    follower = RegistryFollower(cfg)
    await follower.start()
    try:
        latest: dict[str, RegistryRecord] = {}
        for record in await follower.catch_up():
            if record.removal and not removed:
                latest.pop(record.experiment_id, None)
            else:
                latest[record.experiment_id] = record
        return latest
    finally:
        await follower.aclose()


async def declared_experiment(cfg: PipelineConfig, experiment_id: str) -> ExperimentSpec | None:
    """The registry's declaration (:class:`ExperimentSpec`) of ``experiment_id``;
    ``None`` for :data:`DEFAULT_EXPERIMENT` (the workers' own config file, never in the registry).

    The one check behind ``publish``, ``status``, ``trainer``, :class:`shaper.reward_client.RewardClient`
    and the gateway (docs/fleet.md); the tools that only read recorded topics use
    :func:`recorded_experiment`. Reads the registry topic (``topics.experiments``) to its end.

    Raises:
        UnknownExperiment: the registry holds no declaration for it; the message names
            the registry, what it does hold and the command that declares one.
    """
    if experiment_id == DEFAULT_EXPERIMENT:
        return None
    return _declaration(cfg, experiment_id, await read_registry(cfg, removed=True))


def _declaration(cfg: PipelineConfig, experiment_id: str, registry: dict[str, Any]) -> ExperimentSpec:
    """:func:`declared_experiment` on a registry read with its removals."""
    entry = registry.get(experiment_id)
    if entry is not None and entry.spec is not None:
        return entry.spec
    if entry is None:
        why = "not declared"
    elif entry.removal:
        why = f"removed at offset {entry.offset}"
    else:
        why = f"its latest record was refused: {entry.error[:200]}"
    declared = sorted(k for k, v in registry.items() if v.spec is not None)
    raise UnknownExperiment(
        f"experiment {experiment_id!r} has no declaration in the registry {cfg.topics.experiments} ({why}; "
        f"declared: {', '.join(declared) or 'none'}): no worker reads its topics, so nothing would ever be scored; "
        "declare it first with `prm-pipeline experiment add FILE.yaml`"
    )


@dataclass(frozen=True, slots=True)
class RecordedExperiment:
    """An experiment whose recorded topics a reading tool may read (:func:`recorded_experiment`).

    ``spec``: its declaration (the last one, kept by its removal, when ``removed``); None for
    :data:`DEFAULT_EXPERIMENT` and for an experiment removed by a tombstone that kept nothing.
    """

    experiment_id: str
    spec: ExperimentSpec | None
    removed: bool = False
    removed_at_offset: int = -1


async def recorded_experiment(cfg: PipelineConfig, experiment_id: str) -> RecordedExperiment:
    """The check behind the tools that only *read* one experiment's topics (``verdicts``,
    ``inspect --group``, ``audit``, ``dead-letters --experiment``): a declared experiment, or
    one removed since — its verdicts and trajectories stay readable and auditable.

    Raises:
        UnknownExperiment: the registry never declared it (or only a refused record).
    """
    if experiment_id == DEFAULT_EXPERIMENT:
        return RecordedExperiment(experiment_id, None)
    registry = await read_registry(cfg, removed=True)
    entry = registry.get(experiment_id)
    if entry is not None and entry.removal:
        return RecordedExperiment(experiment_id, entry.kept, removed=True, removed_at_offset=entry.offset)
    return RecordedExperiment(experiment_id, _declaration(cfg, experiment_id, registry))


def removed_note(cfg: PipelineConfig, recorded: RecordedExperiment) -> str:
    """The one line a reading tool prints (to stderr) about a removed experiment."""
    return (
        f"note: experiment {recorded.experiment_id!r} was removed from the registry {cfg.topics.experiments} "
        f"(offset {recorded.removed_at_offset}); reading its recorded topics, which no worker scores any more"
    )
