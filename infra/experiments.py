"""Experiment ids: what they look like, how they scope group ids, which topics they own.

One scoring fleet serves many RL experiments. Every wire message may name its
experiment (``experiment_id``; absent means :data:`DEFAULT_EXPERIMENT`, so producers
and consumers written before experiments existed keep working unchanged). Two
experiments may use the same group ids: everything that remembers a group — the
ledger's keys and dedupe, the trainer's dedupe, audit — keys it by
:func:`scoped_group`, which leaves the default experiment's group ids exactly as they
were (a running deployment's Redis state stays valid across the upgrade).

A record's experiment is the topic it arrives on, never a field it carries: a record
naming another experiment is refused (:func:`infra.schema.check_channel`), and no
group id can hold :data:`SCOPE_SEPARATOR` (:mod:`infra.ids`), so a scoped key always
names the experiment of the topic its record came from.

Topics are derived, never configured per experiment: experiment ``E`` reads
``<topics.trajectories>.E`` and writes ``<topics.verdicts>.E``; the default experiment
keeps the unsuffixed topics. One obvious name per experiment means producers, workers
and trainers agree without reading the registry (see docs/fleet.md for why an
experiment gets topics of its own: no head-of-line blocking inside a partition,
retention and ACLs per experiment, a trainer reads only its own verdicts).
"""

from __future__ import annotations

import re
from typing import Final

from infra.errors import ConfigError, ConfigurationError

__all__ = [
    "DEFAULT_EXPERIMENT",
    "EXPERIMENT_ID_PATTERN",
    "SCOPE_SEPARATOR",
    "UnknownExperiment",
    "check_experiment_id",
    "experiment_of_topic",
    "scoped_group",
    "split_scoped",
    "trajectories_topic",
    "turn_samples_topic",
    "verdicts_topic",
]

DEFAULT_EXPERIMENT: Final = "default"
"""The experiment of every record that names none."""

EXPERIMENT_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""Legal in a Kafka topic name, a Redis key and a metric label; bounded (64 characters)."""

SCOPE_SEPARATOR: Final = "\x1f"
"""ASCII unit separator between an experiment id and a group id in a scoped group key.
It cannot appear in an experiment id, so the split is unambiguous."""


def check_experiment_id(experiment_id: str) -> str:
    """``experiment_id`` if it is well formed, else ``ValueError`` saying what is allowed."""
    if not isinstance(experiment_id, str) or not EXPERIMENT_ID_PATTERN.fullmatch(experiment_id):
        raise ConfigError(
            f"experiment_id {str(experiment_id)[:80]!r} must match {EXPERIMENT_ID_PATTERN.pattern} "
            "(letters, digits, '.', '_', '-'; at most 64 characters)"
        )
    return experiment_id


def scoped_group(experiment_id: str, group_id: str) -> str:
    """The key that names ``group_id`` of ``experiment_id`` in Redis and in every dedupe.

    The default experiment's groups keep their bare id, so state written before
    experiments existed is still found.
    """
    if experiment_id == DEFAULT_EXPERIMENT:
        return group_id
    return f"{experiment_id}{SCOPE_SEPARATOR}{group_id}"


def split_scoped(key: str) -> tuple[str, str]:
    """``(experiment_id, group_id)`` of a :func:`scoped_group` key."""
    experiment_id, sep, group_id = key.partition(SCOPE_SEPARATOR)
    if sep and EXPERIMENT_ID_PATTERN.fullmatch(experiment_id) and group_id:
        return experiment_id, group_id
    return DEFAULT_EXPERIMENT, key


def trajectories_topic(base: str, experiment_id: str) -> str:
    """The topic producers publish ``experiment_id``'s trajectories to (``base`` = ``topics.trajectories``)."""
    return base if experiment_id == DEFAULT_EXPERIMENT else f"{base}.{experiment_id}"


def experiment_of_topic(base: str, topic: str) -> str | None:
    """The experiment whose trajectories topic ``topic`` is (``base`` = ``topics.trajectories``;
    the inverse of :func:`trajectories_topic`), or None when it is none's."""
    if topic == base:
        return DEFAULT_EXPERIMENT
    prefix = f"{base}."
    if topic.startswith(prefix) and EXPERIMENT_ID_PATTERN.fullmatch(topic[len(prefix) :]):
        return topic[len(prefix) :]
    return None


def verdicts_topic(base: str, experiment_id: str) -> str:
    """The topic workers publish ``experiment_id``'s verdicts to (``base`` = ``topics.verdicts``)."""
    return base if experiment_id == DEFAULT_EXPERIMENT else f"{base}.{experiment_id}"


def turn_samples_topic(base: str, experiment_id: str) -> str:
    """The topic workers publish ``experiment_id``'s online turn samples to (``base`` = ``topics.turn_samples``)."""
    return base if experiment_id == DEFAULT_EXPERIMENT else f"{base}.{experiment_id}"


class UnknownExperiment(ConfigurationError, ValueError):
    """An experiment id the registry holds no declaration for (never added, removed, or its
    record was refused). No worker reads its topics, so nothing published there would ever
    get a verdict: every tool that publishes or waits for one experiment refuses it up front
    (:func:`infra.registry.declared_experiment`)."""
