"""Every use of aiokafka's private internals, in one module, checked against the version it was written for.

aiokafka has no public way to do a few things the pipeline needs; each is done here, and
nowhere else, by a function that names the private attribute it relies on:

* :func:`adapt_fetch_wait` — change a running consumer's fetch wait between fetches
  (``Fetcher._fetch_max_wait_ms``, wrapping ``Fetcher._proc_fetch_request``): the
  adaptive wait the embedded broker needs (:class:`infra.kafka.AdaptiveFetchWait`);
* :func:`skip_leave_group` — end a consumer's membership without LeaveGroup
  (``GroupCoordinator._maybe_leave_group``): the embedded broker's group defect
  (``KafkaConfig.leave_group_on_stop``);
* :func:`refresh_metadata` — refresh a consumer's metadata now
  (``AIOKafkaConsumer._client``);
* :func:`report_missing_topics` — start a subscribed consumer without waiting for topics
  that do not exist (``AIOKafkaConsumer._wait_topics``), reporting them instead;
* :func:`forbid_topic_auto_creation` — make every metadata request say
  ``allow_auto_topic_creation=false`` (the ``MetadataRequest`` that ``aiokafka.client``
  and ``aiokafka.admin.client`` build): no client of ours makes a broker create a topic;
* :func:`explain_scram_errors` — turn a SCRAM login refusal into a readable error instead
  of aiokafka 0.14's bare ``KeyError: 'v'``
  (``ScramAuthenticator.process_server_final_message``), installed when a client uses SCRAM;
* :func:`open_connection` — one raw connection, to diagnose a failed bootstrap
  (``aiokafka.conn.create_conn``);
* :func:`record_size` — a record's size in a batch (``DefaultRecordBatchBuilder``).

:func:`problems` lists what no longer matches (the version range :data:`SUPPORTED`, each
attribute, method and parameter relied on); ``tests/unit/test_aiokafka_internals.py``
fails on any, so an aiokafka upgrade breaks a unit test here rather than a workaround in
production. At run time a function whose internals are gone raises
:class:`AiokafkaInternalsChanged` naming them, instead of silently doing nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiokafka
import aiokafka.admin.client
import aiokafka.client
import aiokafka.conn
from aiokafka.conn import ScramAuthenticator, create_conn
from aiokafka.consumer.fetcher import Fetcher
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from infra.errors import ConfigurationError

__all__ = [
    "SUPPORTED",
    "AiokafkaInternalsChanged",
    "adapt_fetch_wait",
    "explain_scram_errors",
    "fetch_wait_ms",
    "forbid_topic_auto_creation",
    "open_connection",
    "problems",
    "record_size",
    "refresh_metadata",
    "report_missing_topics",
    "skip_leave_group",
    "version",
]

SUPPORTED = ((0, 14), (0, 15))
"""The aiokafka versions these internals were checked against: ``[low, high)`` by (major, minor)."""

# What the functions below rely on: (what, object, attribute names set or read in its source).
_SOURCE_NEEDS: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("Fetcher.__init__", Fetcher.__init__, ("self._fetch_max_wait_ms",)),
    ("AIOKafkaConsumer.__init__", aiokafka.AIOKafkaConsumer.__init__, ("self._client",)),
    (
        "AIOKafkaConsumer.start",
        aiokafka.AIOKafkaConsumer.start,
        ("self._fetcher", "self._coordinator", "self._wait_topics()"),
    ),
    ("ScramAuthenticator.__init__", ScramAuthenticator.__init__, ("self._hashname", "self._sasl_plain_username")),
    ("AIOKafkaClient._metadata_update", aiokafka.AIOKafkaClient._metadata_update, ("MetadataRequest(",)),
    (
        "AIOKafkaConsumer._wait_topics",
        aiokafka.AIOKafkaConsumer._wait_topics,
        ("self._subscription.subscription", "self._client._wait_on_metadata"),
    ),
    ("AIOKafkaClient.bootstrap", aiokafka.AIOKafkaClient.bootstrap, ("MetadataRequest(",)),
    (
        "AIOKafkaAdminClient._get_cluster_metadata",
        aiokafka.admin.client.AIOKafkaAdminClient._get_cluster_metadata,
        ("MetadataRequest(",),
    ),
)
# (what, its owner, its name there, the parameters relied on): looked up when checked, so a
# method removed after import is reported too.
_SIGNATURES: tuple[tuple[str, Any, str, tuple[str, ...]], ...] = (
    ("Fetcher._proc_fetch_request", Fetcher, "_proc_fetch_request", ("self", "assignment", "node_id", "request")),
    ("GroupCoordinator._maybe_leave_group", GroupCoordinator, "_maybe_leave_group", ("self",)),
    ("GroupCoordinator.reset_generation", GroupCoordinator, "reset_generation", ("self",)),
    ("AIOKafkaClient.force_metadata_update", aiokafka.AIOKafkaClient, "force_metadata_update", ("self",)),
    (
        "ScramAuthenticator.process_server_final_message",
        ScramAuthenticator,
        "process_server_final_message",
        ("self", "server_final"),
    ),
    (
        "create_conn",
        aiokafka.conn,
        "create_conn",
        (
            "host",
            "port",
            "request_timeout_ms",
            "ssl_context",
            "security_protocol",
            "sasl_mechanism",
            "sasl_plain_username",
            "sasl_plain_password",
        ),
    ),
    (
        "DefaultRecordBatchBuilder.estimate_size_in_bytes",
        DefaultRecordBatchBuilder,
        "estimate_size_in_bytes",
        ("key", "value", "headers"),
    ),
    ("aiokafka.client.MetadataRequest", aiokafka.client, "MetadataRequest", ("topics", "allow_auto_topic_creation")),
    (
        "aiokafka.admin.client.MetadataRequest",
        aiokafka.admin.client,
        "MetadataRequest",
        ("topics", "allow_auto_topic_creation"),
    ),
)
_COROUTINES = ("Fetcher._proc_fetch_request", "GroupCoordinator._maybe_leave_group")


class AiokafkaInternalsChanged(ConfigurationError, RuntimeError):
    """aiokafka no longer has an internal this module relies on: the installed aiokafka is
    not one this module was checked with (pin it, or update the module and its test)."""


def version() -> tuple[int, int]:
    major, minor = (int(part) for part in aiokafka.__version__.split(".")[:2])
    return major, minor


def problems() -> list[str]:
    """What no longer matches the aiokafka these internals were written for (empty: all)."""
    found: list[str] = []
    low, high = SUPPORTED
    if not low <= version() < high:
        found.append(
            f"aiokafka {aiokafka.__version__} is outside the checked range "
            f"[{'.'.join(map(str, low))}, {'.'.join(map(str, high))})"
        )
    for what, function, names in _SOURCE_NEEDS:
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            found.append(f"{what}: source not readable")
            continue
        found += [f"{what} no longer sets or reads {name}" for name in names if name not in source]
    for what, owner, name, params in _SIGNATURES:
        function = getattr(owner, name, None)
        if function is None:
            found.append(f"{what} is gone")
            continue
        have = inspect.signature(function).parameters
        found += [f"{what} has no parameter {name!r}" for name in params if name not in have]
        if what in _COROUTINES and not inspect.iscoroutinefunction(function):
            found.append(f"{what} is no longer a coroutine function")
    return found


def _need(obj: Any, attribute: str, what: str) -> Any:
    value = getattr(obj, attribute, None)
    if value is None:
        raise AiokafkaInternalsChanged(
            f"aiokafka {aiokafka.__version__}: {what} has no {attribute} (infra/aiokafka_internals.py was "
            f"written for {'.'.join(map(str, SUPPORTED[0]))}); run tests/unit/test_aiokafka_internals.py"
        )
    return value


# --------------------------------------------------------------------------- consumers
def adapt_fetch_wait(consumer: aiokafka.AIOKafkaConsumer, after_fetch: Callable[[bool], int]) -> None:
    """After every fetch of a *started* consumer, set the broker-side wait of its next fetch
    to ``after_fetch(the fetch brought records)`` (milliseconds).

    aiokafka builds each fetch request from ``Fetcher._fetch_max_wait_ms`` and has no
    public setter; its ``_proc_fetch_request`` returns True when the response added records.
    """
    fetcher = _need(consumer, "_fetcher", "a started AIOKafkaConsumer")
    fetch: Callable[..., Awaitable[Any]] = _need(fetcher, "_proc_fetch_request", "its Fetcher")
    _need(fetcher, "_fetch_max_wait_ms", "its Fetcher")

    async def fetch_and_adapt(*args: Any) -> Any:
        got = await fetch(*args)
        fetcher._fetch_max_wait_ms = after_fetch(bool(got))
        return got

    fetcher._proc_fetch_request = fetch_and_adapt


def fetch_wait_ms(consumer: aiokafka.AIOKafkaConsumer) -> int:
    """The broker-side wait the consumer's next fetch request carries (milliseconds)."""
    return _need(_need(consumer, "_fetcher", "a started AIOKafkaConsumer"), "_fetch_max_wait_ms", "its Fetcher")


def skip_leave_group(consumer: aiokafka.AIOKafkaConsumer) -> None:
    """Make the consumer's ``stop()`` end its group membership without a LeaveGroup request:
    the coordinator's leave step becomes the reset of the generation it does afterwards
    (membership then ends at the broker by session expiry). aiokafka has no switch for it.
    A consumer without a group (``group_id=None``) is left as it is."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or not isinstance(coordinator, GroupCoordinator):
        return
    _need(coordinator, "_maybe_leave_group", "its GroupCoordinator")
    reset = _need(coordinator, "reset_generation", "its GroupCoordinator")

    async def forget_membership() -> None:
        reset()

    coordinator._maybe_leave_group = forget_membership


async def refresh_metadata(consumer: aiokafka.AIOKafkaConsumer) -> None:
    """Refresh the consumer's cluster metadata now (a topic created a moment ago)."""
    await _need(consumer, "_client", "an AIOKafkaConsumer").force_metadata_update()


def report_missing_topics(consumer: aiokafka.AIOKafkaConsumer, report: Callable[[str], None]) -> None:
    """Make a subscribed consumer's ``start()`` call ``report(topic)`` for each subscribed
    topic the broker does not have, and go on with the others, instead of waiting
    ``request_timeout_ms`` for it and then raising ``UnknownTopicOrPartitionError``.

    With topic auto-creation off (:func:`forbid_topic_auto_creation`) a subscribed topic
    that does not exist stays missing; one experiment without its topics must not stop a
    worker that serves others. The group assigns the partitions that exist, and a topic
    created later joins at the next metadata refresh.
    """
    _need(consumer, "_wait_topics", "an AIOKafkaConsumer")
    subscription = _need(consumer, "_subscription", "an AIOKafkaConsumer")
    client = _need(consumer, "_client", "an AIOKafkaConsumer")

    async def wait_for_existing_topics() -> None:
        if subscription.subscription is None:
            return
        topics = sorted(subscription.subscription.topics)
        for topic in topics:
            await client.add_topic(topic)  # one metadata request naming it (never creating it)
        for topic in topics:
            if client.cluster.partitions_for_topic(topic) is None:
                report(topic)

    consumer._wait_topics = wait_for_existing_topics


def forbid_topic_auto_creation() -> None:
    """Make every metadata request of aiokafka's clients and admin clients carry
    ``allow_auto_topic_creation=false`` (idempotent; process-wide).

    aiokafka asks for auto-creation in every metadata request (v4 and later) and has no
    switch for it, so a producer's first send or a consumer's subscription to a missing
    topic made the broker create it: the embedded broker with 4 partitions whatever
    ``topics.partitions`` says (tansu has no setting to turn auto-creation off), Apache
    Kafka with its ``num.partitions`` unless ``auto.create.topics.enable`` is off. With
    this, a missing topic stays missing, and the command says so with the fix
    (:class:`infra.kafka.TopicMissing`): topics are made by ``prm-pipeline topics create``.
    """
    for module in (aiokafka.client, aiokafka.admin.client):
        current = _need(module, "MetadataRequest", module.__name__)
        if getattr(current, "_prm_no_auto_creation", False):
            continue

        class MetadataRequestWithoutAutoCreation(current):  # type: ignore[misc, valid-type]
            _prm_no_auto_creation = True

            def __init__(self, topics: list[str] | None = None, allow_auto_topic_creation: bool | None = False) -> None:
                super().__init__(topics, allow_auto_topic_creation)

        module.MetadataRequest = MetadataRequestWithoutAutoCreation


# --------------------------------------------------------------------------- connections
def explain_scram_errors(make_error: Callable[[str, str, str], Exception]) -> None:
    """Make a SCRAM login refusal raise ``make_error(mechanism, user, error)`` (idempotent).

    aiokafka 0.14 turns a ``server-final-message`` carrying an error (``e=unknown-user``,
    ``e=invalid-proof``, ...) into a bare ``KeyError: 'v'``.
    """
    original = _need(ScramAuthenticator, "process_server_final_message", "ScramAuthenticator")
    if getattr(original, "_prm_explained", False):
        return

    def process_server_final_message(self: Any, server_final: str) -> None:
        params = dict(p.split("=", 1) for p in server_final.split(",") if "=" in p)
        if "e" in params and "v" not in params:
            mechanism = "SCRAM-" + self._hashname.upper().replace("SHA", "SHA-")
            raise make_error(mechanism, self._sasl_plain_username, params["e"])
        original(self, server_final)

    process_server_final_message._prm_explained = True  # type: ignore[attr-defined]
    process_server_final_message.__wrapped__ = original  # type: ignore[attr-defined]
    ScramAuthenticator.process_server_final_message = process_server_final_message


async def open_connection(host: str, port: int, **kwargs: Any) -> Any:
    """One raw broker connection (``aiokafka.conn.create_conn``, keyword arguments as there):
    to tell why a bootstrap failed. Close it with ``.close()``."""
    return await create_conn(host, port, **kwargs)


def record_size(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] | None) -> int:
    """A record's size in a record batch (what counts against ``max.message.bytes``)."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers or ()))
