"""One root for every exception prm-pipeline raises on purpose, with typed subtrees.

A library user catches :class:`PRMPipelineError` for "anything this package refused or
could not do", or one subtree (as httpx's ``HTTPError`` / ``RequestError`` /
``TransportError``):

* :class:`ConfigurationError` — a setting, config file or argument is wrong (``ConfigError``,
  with ``RegistryError``, ``CapabilityError`` and ``ScorerArgumentError``, ``TokenizerError``,
  ``UnknownExperiment``);
* :class:`WireError` — a message, record or file breaks the wire contract
  (``SchemaError`` and its kinds, ``IncompleteTrajectory`` for chunked records,
  ``JsonlError``, ``TreeError``, ``NotConcatExport``, ``MessageTooLarge``,
  ``ExperimentMismatch`` (a message for another experiment's publisher), and the
  gateway's ``BadRequest``);
* :class:`ServiceError` — Kafka, Redis or a local service is unreachable or refuses us
  (``ServiceUnavailable``, ``KafkaUnreachable``, ``KafkaAccessRefused``,
  ``RedisAccessError``, ``LocalStackError``, ``PublishError``, ``TopicMissing``);
* :class:`ScoringError` — scoring a trajectory failed (``JudgeRequestError`` and its
  kinds, ``JudgeFailedError``, ``MissingLogprobsError``, ``RunnerClosedError``,
  ``ProcessingError``);
* :class:`TrainingError` — the trainer side could not use a verdict (``ConcatExportError``,
  ``VerdictTimeout``, ``VerdictMismatch``) or was handed a malformed batch
  (``ShapingInputError``).

``AuditError`` (an audit could not read the records it was asked to) derives from the
root directly.

The existing classes keep their standard bases (``ValueError``, ``RuntimeError``,
``ConnectionError``, ``TimeoutError``, …): the root is mixed in, so every ``except``
clause written before it still catches what it caught. Exceptions a scorer raises are
the scorer's own (AReaL semantics) and are not wrapped.

Argument and input checks of public functions and constructors raise these classes too
(``ConfigError`` for a setting or argument, ``SchemaError`` for a message's fields,
``ShapingInputError`` for a trainer's tensors), each a ``ValueError`` or ``RuntimeError``
as the bare one it replaced. Left bare on purpose: an object used outside its lifecycle
(before ``start()``, after ``close()``, from its own event loop), which is a bug of the
calling code; a check whose error is caught and turned into another inside the package;
and internal assertions of states the code never reaches.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "PRMPipelineError",
    "ScoringError",
    "ServiceError",
    "TrainingError",
    "WireError",
]


class PRMPipelineError(Exception):
    """Root of every exception prm-pipeline raises on purpose."""


class ConfigurationError(PRMPipelineError):
    """A setting, config file or command-line option is wrong."""


class WireError(PRMPipelineError):
    """A message, Kafka record or JSONL line breaks the wire contract (docs/wire.md)."""


class ServiceError(PRMPipelineError):
    """Kafka, Redis or a local service is unreachable, or refuses what we ask."""


class ScoringError(PRMPipelineError):
    """Scoring a trajectory failed (a judge or teacher request, the runner, a record)."""


class TrainingError(PRMPipelineError):
    """The trainer side could not use a verdict."""


class ConfigError(ConfigurationError, ValueError):
    """The configuration breaks a rule; the message names the key and the fix (also
    importable from :mod:`infra.config`, where its rules live)."""
