"""The one place that builds Kafka clients and manages topics.

Every producer, consumer and admin client in the project comes from here, so
security settings (SASL/TLS), compression, size limits and timeouts are applied
the same way everywhere.

Delivery model: at-least-once. We never rely on the idempotent producer or on
transactions (the embedded tansu broker cannot do either, see infra.local); consumers
are idempotent instead and commit offsets manually after outcomes are durable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import TopicPartition

from infra import aiokafka_internals as internals
from infra.config import KafkaConfig, TopicsConfig, bootstrap_servers
from infra.errors import ServiceError, WireError

log = logging.getLogger(__name__)


class MessageTooLarge(WireError, ValueError):
    """A record is larger than what ``kafka.max_message_bytes`` lets it be
    (:func:`max_record_size`).

    Checked client-side because the embedded tansu broker enforces no limit while a real
    Kafka cluster (1 MiB default) would reject the record at produce time.
    """


def record_size(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] | None) -> int:
    """The size the producer checks against ``max_request_size`` (= ``kafka.max_message_bytes``)
    for one record: value, key, headers and the record's own framing — an upper bound of
    the uncompressed record batch that carries it alone (the 61-byte batch header and at
    most 21 bytes of record framing included). Compare it with :func:`max_record_size`,
    not with ``kafka.max_message_bytes``: compression can make the batch larger."""
    return internals.record_size(key, value, headers)


RECORD_BATCH_HEADER = 61
"""Bytes of a record batch (format v2, the one aiokafka writes) before its records: base
offset 8, length 4, leader epoch 4, magic 1, CRC 4, attributes 2, last offset delta 4,
first and max timestamps 8 + 8, producer id 8, producer epoch 2, base sequence 4, record
count 4. It is never compressed; the records after it are compressed as one block."""

COMPRESSIONS = ("zstd", "lz4", "gzip", "none")
"""The codecs ``kafka.compression`` may name. zstd's worst-case expansion is the largest
of them at every size (``tests/unit/test_kafka.py``), so it is the default of
:func:`compress_bound` and :func:`max_record_size`."""


def compress_bound(size: int, compression: str = "zstd") -> int:
    """The most bytes ``size`` bytes can take once compressed with ``compression`` in the
    frame aiokafka writes (its C record builder sends the compressed block even when it
    is larger than the input, as it is for random bytes):

    * ``zstd``: ``ZSTD_COMPRESSBOUND`` of zstd.h (single-shot compression, which
      aiokafka's ``cramjam.zstd.compress`` is): ``size + size/256``, plus up to 64 bytes
      below 128 KiB;
    * ``lz4``: ``LZ4F_compressFrameBound`` for the smallest block size (64 KiB, the most
      block headers), block and content checksums on: a 19-byte frame header, 8 bytes per
      block (size and checksum; an incompressible block is stored raw), an end mark and
      the content checksum;
    * ``gzip``: zlib's ``compressBound`` with the gzip wrapper (18 bytes) instead of
      zlib's (6);
    * ``none``: ``size``.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, not {size}")
    if compression == "zstd":
        return size + (size >> 8) + ((((128 << 10) - size) >> 11) if size < (128 << 10) else 0)
    if compression == "lz4":
        return 19 + size + 8 * -(-size // (64 << 10)) + 4 + 4
    if compression == "gzip":
        return size + (size >> 12) + (size >> 14) + (size >> 25) + 13 - 6 + 18
    if compression == "none":
        return size
    raise ValueError(f"unknown compression {compression!r}: one of {', '.join(COMPRESSIONS)}")


def max_record_size(max_message_bytes: int, compression: str = "zstd") -> int:
    """The largest :func:`record_size` (value + key + headers with their framing) that is
    safe under ``max_message_bytes`` (a topic's ``max.message.bytes``): every size the
    project caps or checks a record to (dead letters, verdicts, chunks, registry records).

    A broker checks ``max.message.bytes`` against the whole record batch as written —
    its 61-byte header (:data:`RECORD_BATCH_HEADER`) plus the records *after
    compression*. Incompressible bytes (a payload of random bytes, already-compressed
    data) grow under compression, so a record whose :func:`record_size` is exactly the
    limit becomes a batch over it, which the broker refuses (``MessageSizeTooLarge``).
    The answer is the largest ``s`` with
    ``RECORD_BATCH_HEADER + compress_bound(s - RECORD_BATCH_HEADER) <= max_message_bytes``
    (:func:`record_size` already counts the header and an upper bound of the record
    framing). With ``compression="none"`` it is ``max_message_bytes`` itself; the default,
    zstd, has the largest bound of :data:`COMPRESSIONS`, so its answer is safe whatever
    ``kafka.compression`` says. For the default 1 MiB limit with zstd: 1,044,497 bytes,
    4,079 below the limit (the 61-byte header and the record framing are in both figures).
    """
    budget = max_message_bytes - RECORD_BATCH_HEADER  # what the compressed records may take
    if compress_bound(0, compression) > budget:
        return 0
    lo, hi = 0, budget  # compress_bound(lo) <= budget < compress_bound(hi + 1); the bound never decreases
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if compress_bound(mid, compression) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return RECORD_BATCH_HEADER + lo


class KafkaAccessRefused(ServiceError, RuntimeError):
    """The broker can be reached but refuses us for a reason no retry fixes (an untrusted
    certificate, TLS spoken to a plaintext listener or the reverse, a refused login);
    ``str()`` is the one-line report naming the setting to fix."""


class TopicCreationFailed(ServiceError, RuntimeError):
    """The broker refused to create a topic for a reason other than authorization (an invalid
    replication factor or config, a policy); ``str()`` is one line with Kafka's error code."""

    def __init__(self, topic: str, code: int) -> None:
        super().__init__(
            f"creating topic {topic!r} failed with Kafka error code {code} (see the broker's log; "
            "topics.partitions, topics.replication_factor and topics.retention_ms set what is asked)"
        )
        self.topic, self.code = topic, code


class TopicMissing(ServiceError, RuntimeError):
    """A topic a command reads does not exist on the broker; ``str()`` is one line with the fix."""

    def __init__(self, topic: str) -> None:
        super().__init__(
            f"topic {topic!r} does not exist; `prm-pipeline topics create` creates the configured "
            "topics and those of every experiment declared in the registry"
        )
        self.topic = topic


class KafkaAuthError(KafkaAccessRefused):
    """The broker refused our SASL login; the message names the user and the settings to check.

    aiokafka 0.14 turns a SCRAM ``server-final-message`` carrying an error (``e=unknown-user``,
    ``e=invalid-proof``, ...) into a bare ``KeyError: 'v'``; every client configured for
    SCRAM (:func:`common_kwargs`) has it translated into this error
    (:func:`infra.aiokafka_internals.explain_scram_errors`).
    """

    @classmethod
    def scram_refused(cls, mechanism: str, user: str, error: str) -> KafkaAuthError:
        return cls(
            f"Kafka refused the {mechanism} login of user {user!r}: {error} "
            "(check kafka.sasl_username / PRM_KAFKA_SASL_USERNAME, kafka.sasl_password / "
            "PRM_KAFKA_SASL_PASSWORD and kafka.sasl_mechanism)"
        )


async def diagnose_connection(cfg: KafkaConfig) -> KafkaAccessRefused | str:
    """Why a client could not bootstrap (aiokafka only says "Unable to bootstrap").

    Opens one connection to the first bootstrap server with the configured security
    settings. A refusal no retry fixes (an untrusted certificate, a TLS listener spoken
    to in plaintext or the reverse, a refused login) comes back as a
    :class:`KafkaAccessRefused`; anything else (nothing listening yet, a timeout) as a
    one-line description of the outage.
    """
    import ssl

    from aiokafka.errors import KafkaConnectionError

    host, port = bootstrap_servers(cfg.bootstrap)[0]
    kw = common_kwargs(cfg)
    where = f"Kafka at {host}:{port} (kafka.bootstrap, security_protocol={cfg.security_protocol})"
    try:
        conn = await internals.open_connection(
            host,
            port,
            ssl_context=kw.get("ssl_context"),
            security_protocol=cfg.security_protocol,
            sasl_mechanism=kw.get("sasl_mechanism", "PLAIN"),
            sasl_plain_username=cfg.sasl_username,
            sasl_plain_password=cfg.sasl_password,
            request_timeout_ms=min(cfg.request_timeout_ms, 10_000),
        )
    except ssl.SSLCertVerificationError as exc:
        return KafkaAccessRefused(
            f"{where}: its TLS certificate is not trusted ({exc.verify_message}); "
            f"kafka.ssl_cafile is {cfg.ssl_cafile or 'unset (system trust store)'}"
        )
    except ssl.SSLError as exc:
        return KafkaAccessRefused(f"{where}: TLS handshake failed ({exc.reason or exc}); does the listener speak TLS?")
    except ConnectionRefusedError:
        return f"{where}: connection refused, nothing listens there"
    except KafkaAuthError as exc:
        return exc
    except (KafkaConnectionError, OSError, TimeoutError) as exc:
        if cfg.security_protocol in ("PLAINTEXT", "SASL_PLAINTEXT"):
            return KafkaAccessRefused(
                f"{where}: the broker closed the connection ({exc}); if the listener expects TLS, "
                "set kafka.security_protocol to SSL or SASL_SSL and kafka.ssl_cafile"
            )
        return f"{where}: {exc}"
    conn.close()
    return f"{where}: the first server answers; another broker advertised in its metadata does not"


def common_kwargs(cfg: KafkaConfig) -> dict[str, Any]:
    """Connection settings shared by every client: bootstrap, client id, SASL, TLS. No client
    built with them has the broker create a topic (:func:`infra.aiokafka_internals.forbid_topic_auto_creation`)."""
    internals.forbid_topic_auto_creation()
    kwargs: dict[str, Any] = {
        "bootstrap_servers": cfg.bootstrap,
        "client_id": cfg.client_id,
        "security_protocol": cfg.security_protocol,
        "request_timeout_ms": cfg.request_timeout_ms,
    }
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context(
            cafile=cfg.ssl_cafile, certfile=cfg.ssl_certfile, keyfile=cfg.ssl_keyfile
        )
    if cfg.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = cfg.sasl_mechanism or "PLAIN"
        kwargs["sasl_plain_username"] = cfg.sasl_username
        kwargs["sasl_plain_password"] = cfg.sasl_password
        if kwargs["sasl_mechanism"].upper().startswith("SCRAM"):
            internals.explain_scram_errors(KafkaAuthError.scram_refused)
    return kwargs


def make_producer(cfg: KafkaConfig, **overrides: Any) -> AIOKafkaProducer:
    """A producer with acks=all, compression, linger batching and the size limit.

    Its batches hold at most :func:`max_record_size` bytes before compression (aiokafka's
    16 KiB unless the limit is smaller), so a batch of several records is never over
    ``kafka.max_message_bytes`` once compressed; a record larger than that travels alone.
    """
    kwargs = common_kwargs(cfg)
    kwargs.update(
        acks="all",
        compression_type=None if cfg.compression == "none" else cfg.compression,
        linger_ms=cfg.linger_ms,
        max_request_size=cfg.max_message_bytes,
        max_batch_size=min(16_384, max_record_size(cfg.max_message_bytes, cfg.compression)),
        enable_idempotence=False,  # unsupported by tansu; consumers dedupe instead
    )
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)


class AdaptiveFetchWait:
    """The broker-side wait of a consumer's next fetch: short while records flow, long when idle.

    After a fetch that brought records the next one waits ``low_ms``; each fetch that came
    back empty doubles the wait, up to ``high_ms``. A broker that looks for new records
    only at points within the wait (the embedded tansu broker answers at about half of it,
    see docs/capacity.md) delays a record by up to half the wait in force when it arrives,
    and costs a request per wait when nothing comes: one fixed wait buys either latency under load or cheap idling, this
    buys both. On Apache Kafka, which answers as soon as data arrives, it only shortens
    the waits right after records came.
    """

    __slots__ = ("low_ms", "high_ms", "wait_ms")

    def __init__(self, low_ms: int, high_ms: int) -> None:
        self.high_ms = max(1, high_ms)
        self.low_ms = max(1, min(low_ms, self.high_ms))
        self.wait_ms = self.low_ms

    def after_fetch(self, got_records: bool) -> int:
        """The wait for the next fetch, given whether the last one brought records."""
        self.wait_ms = self.low_ms if got_records else min(self.high_ms, self.wait_ms * 2)
        return self.wait_ms


class PipelineConsumer(AIOKafkaConsumer):
    """An aiokafka consumer whose polls keep their timeout and, for brokers that need them
    (the embedded one: the local stack's settings, ``infra.local.LOCAL_BROKER_CLIENT``),
    that can skip LeaveGroup and whose fetch wait can adapt to the traffic
    (:class:`AdaptiveFetchWait`).

    ``leave_group_on_stop=False``: membership ends by session expiry instead of LeaveGroup
    (see ``KafkaConfig.leave_group_on_stop`` for the broker defect this avoids;
    :func:`infra.aiokafka_internals.skip_leave_group`). ``fetch_wait`` with a range
    (``low_ms < high_ms``): the wait of each fetch follows it
    (:func:`infra.aiokafka_internals.adapt_fetch_wait`).
    """

    def __init__(
        self, *topics: str, leave_group_on_stop: bool = True, fetch_wait: AdaptiveFetchWait | None = None, **kwargs: Any
    ) -> None:
        if fetch_wait is not None:
            kwargs["fetch_max_wait_ms"] = fetch_wait.wait_ms
        super().__init__(*topics, **kwargs)
        self.leave_group_on_stop = leave_group_on_stop
        self.fetch_wait = fetch_wait

    async def start(self) -> None:
        # a subscribed topic that does not exist is reported, not waited for (then raised)
        internals.report_missing_topics(
            self, lambda topic: log.warning("%s; not consumed until it exists", TopicMissing(topic))
        )
        await super().start()
        fetch_wait = self.fetch_wait
        if fetch_wait is not None and fetch_wait.low_ms < fetch_wait.high_ms:
            internals.adapt_fetch_wait(self, fetch_wait.after_fetch)

    async def getmany(
        self, *partitions: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict[TopicPartition, list[Any]]:
        """aiokafka's ``getmany``, but ``timeout_ms`` holds during a rebalance too.

        aiokafka waits for a rebalance in progress to finish, ignoring ``timeout_ms``; a
        caller polling in a loop then cannot see its stop signal (a worker ignored SIGTERM
        for as long as its group could not form). Cancelling that wait takes no records.
        """
        fetch = asyncio.ensure_future(super().getmany(*partitions, timeout_ms=timeout_ms, max_records=max_records))
        try:
            done, _ = await asyncio.wait({fetch}, timeout=timeout_ms / 1000 + 0.05)
        except asyncio.CancelledError:
            fetch.cancel()
            raise
        if not done:
            fetch.cancel()
            await asyncio.wait({fetch})  # the cancel lands, or the records it had taken are kept
            if fetch.cancelled():
                return {}
        return fetch.result()

    async def stop(self) -> None:
        if not self.leave_group_on_stop:
            internals.skip_leave_group(self)
        await super().stop()


def make_consumer(cfg: KafkaConfig, *topics: str, group_id: str | None, **overrides: Any) -> PipelineConsumer:
    """A consumer with manual commits (``enable_auto_commit=False``) reading from the earliest
    offset; its polls keep their timeout, it honours ``kafka.leave_group_on_stop`` and,
    with ``kafka.fetch_min_wait_ms`` set, its fetch wait moves between that and
    ``kafka.fetch_max_wait_ms`` with the traffic (:class:`PipelineConsumer`; an override of
    either bounds it); without, every fetch waits ``kafka.fetch_max_wait_ms``."""
    kwargs = common_kwargs(cfg)
    kwargs.update(
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_poll_interval_ms=cfg.max_poll_interval_ms,
        fetch_max_bytes=max(52_428_800, cfg.max_message_bytes * 4),
        max_partition_fetch_bytes=max(1_048_576, cfg.max_message_bytes),
    )
    high_ms = overrides.pop("fetch_max_wait_ms", cfg.fetch_max_wait_ms)
    low_ms = overrides.pop("fetch_min_wait_ms", cfg.fetch_min_wait_ms)
    kwargs.update(overrides, fetch_max_wait_ms=high_ms)
    fetch_wait = None if low_ms is None else AdaptiveFetchWait(low_ms, high_ms)
    return PipelineConsumer(*topics, leave_group_on_stop=cfg.leave_group_on_stop, fetch_wait=fetch_wait, **kwargs)


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, *, timeout_s: float = 5.0) -> list[TopicPartition]:
    """Every partition of ``topic``, waiting up to ``timeout_s`` for its metadata (a topic
    created a moment ago may not be known to the client yet); a topic that never shows
    up is :class:`TopicMissing` (one line with the fix) within that time, not an endless
    wait (the metadata requests never have the broker create it)."""
    deadline = time.monotonic() + timeout_s
    partitions = consumer.partitions_for_topic(topic)
    while not partitions:
        if time.monotonic() > deadline:
            raise TopicMissing(topic)
        await internals.refresh_metadata(consumer)
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await asyncio.sleep(0.05)
    return [TopicPartition(topic, p) for p in sorted(partitions)]


async def assign_from_start(consumer: AIOKafkaConsumer, *topics: str, timeout_s: float = 5.0) -> list[TopicPartition]:
    """Assign every partition of ``topics`` to a started, group-less consumer and seek each
    to its beginning; returns the partitions (see :func:`partitions_of`)."""
    tps: list[TopicPartition] = []
    for topic in topics:
        tps += await partitions_of(consumer, topic, timeout_s=timeout_s)
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    return tps


def make_admin(cfg: KafkaConfig) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**common_kwargs(cfg))


def check_size(
    value: bytes,
    cfg: KafkaConfig,
    what: str,
    key: bytes | None = None,
    headers: Sequence[tuple[str, bytes]] | None = None,
) -> None:
    """Raise :class:`MessageTooLarge` before a record that a real broker would refuse is
    sent: one whose :func:`record_size` is over :func:`max_record_size`."""
    size, safe = record_size(key, value, headers), max_record_size(cfg.max_message_bytes, cfg.compression)
    if size > safe:
        raise MessageTooLarge(
            f"{what} is {size} bytes, over the {safe} a record may have under kafka.max_message_bytes="
            f"{cfg.max_message_bytes} ({cfg.compression}); "
            "split the trajectory, or raise the limit here and on the broker/topic "
            "(message.max.bytes / max.message.bytes)"
        )


def _new_topic(name: str, kafka: KafkaConfig, topics: TopicsConfig) -> NewTopic:
    if name == topics.experiments:  # the registry: one partition (one order), latest record per key kept
        return NewTopic(
            name=name,
            num_partitions=1,
            replication_factor=topics.replication_factor,
            topic_configs={"cleanup.policy": "compact"},
        )
    return NewTopic(
        name=name,
        num_partitions=wanted_partitions(name, topics),
        replication_factor=topics.replication_factor,
        topic_configs={"retention.ms": str(topics.retention_ms), "max.message.bytes": str(kafka.max_message_bytes)},
    )


def wanted_partitions(name: str, topics: TopicsConfig) -> int:
    """The partitions ``topics create`` gives ``name``: 1 for the registry (one order),
    ``topics.partitions`` for every other topic."""
    return 1 if name == topics.experiments else topics.partitions


@dataclass(frozen=True)
class TopicState:
    """What :func:`ensure_topics` found or did for one topic: ``created``, ``exists``, or
    ``differs`` (it exists with another partition count than the config asks for)."""

    name: str
    state: Literal["created", "exists", "differs"]
    partitions: int
    wanted: int

    def __str__(self) -> str:
        line = f"{self.state:8} {self.name}"
        if self.state == "differs":
            line += (
                f": {self.partitions} partitions, the config asks for {self.wanted}; `topics create` changes "
                "no existing topic: add partitions on the broker (the embedded one cannot), recreate the topic "
                "while nothing uses it, or make topics.partitions match"
            )
        return line


async def topic_partitions(kafka: KafkaConfig, names: Iterable[str]) -> dict[str, int]:
    """The partition count of each of ``names`` that exists (a missing one is left out).

    One metadata request naming the topics, which never has the broker create one
    (:func:`infra.aiokafka_internals.forbid_topic_auto_creation`)."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return {}
    admin = make_admin(kafka)
    await admin.start()
    try:
        described = await admin.describe_topics(wanted)
    finally:
        await admin.close()
    return {t["topic"]: len(t["partitions"]) for t in described if t["error_code"] == 0 and t["partitions"]}


async def require_topics(kafka: KafkaConfig, names: Iterable[str]) -> None:
    """Raise :class:`TopicMissing` (one line with the fix) for the first of ``names`` the
    broker does not have: checked before a command builds a producer or consumer for them,
    so a missing topic is reported at once, is not created by accident, and leaves no
    client behind."""
    wanted = list(dict.fromkeys(names))
    have = await topic_partitions(kafka, wanted)
    for name in wanted:
        if name not in have:
            raise TopicMissing(name)


async def ensure_topics(
    kafka: KafkaConfig, topics: TopicsConfig, names: Iterable[str] | None = None
) -> dict[str, TopicState]:
    """Create the configured topics if missing; returns each topic's :class:`TopicState`.

    Idempotent: an existing topic is reported, not an error. Its partition count is left
    alone (the embedded broker cannot change it, and shrinking is never safe), but one
    that differs from the config's (a topic the broker auto-created, or an older config)
    is reported as ``differs``.
    """
    wanted = (
        list(names)
        if names is not None
        else [topics.trajectories, topics.verdicts, topics.dead_letters, topics.experiments]
    )
    existing = await topic_partitions(kafka, wanted)
    result = {
        n: TopicState(
            n, "exists" if count == wanted_partitions(n, topics) else "differs", count, wanted_partitions(n, topics)
        )
        for n, count in existing.items()
    }
    missing = [n for n in wanted if n not in existing]
    if missing:
        admin = make_admin(kafka)
        await admin.start()
        try:
            response = await admin.create_topics([_new_topic(n, kafka, topics) for n in missing])
        finally:
            await admin.close()
        for name, code, *_ in getattr(response, "topic_errors", []):
            if code in (29, 31):  # TOPIC_ / CLUSTER_AUTHORIZATION_FAILED: the operator must grant it
                raise KafkaAccessRefused(
                    f"the broker refuses to create topic {name!r} (Kafka error code {code}: not authorized); "
                    "grant CREATE to the principal of kafka.sasl_username, or create the topics beforehand"
                )
            if code not in (0, 36):  # 36 = TOPIC_ALREADY_EXISTS (a concurrent creator won)
                raise TopicCreationFailed(name, code)
            count = wanted_partitions(name, topics)
            result[name] = TopicState(name, "created" if code == 0 else "exists", count, count)
    return {n: result[n] for n in wanted if n in result}
