"""Wire schemas: the one definition of every message that crosses Kafka.

Long on purpose: the one definition of every wire message; splitting it would make two places to look for the contract.

(Over 500 lines on purpose: every wire message and its codec live in this one module.)

Design rules (after msgspec's own): few precise types, validation at the boundary
(``__post_init__`` runs on construction *and* on decode, so an invalid message can
never enter the pipeline), plain data inside. Token arrays travel as packed
little-endian bytes and are exposed as zero-copy, read-only numpy views, so decoding
a 32k-token trajectory creates no per-token Python objects.

Every Kafka record carries two headers: :data:`SCHEMA_HEADER` (the schema version)
and :data:`KIND_HEADER` (``ready``, ``discard``, ``chunk``, ``turn``, ``end``, ``verdict``). Decoding checks
both and raises a :class:`SchemaError` subclass that says what was wrong.

Long sessions travel in the *compact* form (schema version 2): each interaction carries
only what is new since its parent (``shared_messages`` / ``shared_tokens`` say how much
of the parent's context it repeats), and a record too large for one Kafka message is
split into ``chunk`` records. :func:`decode_message` expands compact trajectories
(:func:`expand_trajectory`, the same expansion the verdict's :class:`TokenTurn` turns
use), so readers see full interactions whatever the producer sent. :func:`encode`
writes version 1 for everything version 1 can express, so older readers keep reading
full-form records, and refuse (instead of misreading) compact ones.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from infra import reasons
from infra.errors import WireError
from infra.experiments import DEFAULT_EXPERIMENT, check_experiment_id
from infra.ids import ExperimentId, WireId
from infra.prefix import Part, expand_messages, expand_prompts, same_bytes, shared_list_prefix, shared_token_prefix
from infra.tree import TreeError, topological_order
from infra.types import MAX_TOKEN_ID, validating

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 1
"""The version of every record version 1 can express (full-form trajectories, discards, verdicts)."""
COMPACT_SCHEMA_VERSION = 2
"""Compact trajectories (an interaction with ``shared_messages``/``shared_tokens``) and chunks."""
SUPPORTED_SCHEMA_VERSIONS = frozenset({1, 2})
MAX_TURN_TOKENS = 1 << 24
"""A verdict's per-turn token rewards cover at most this many tokens (16,777,216; a turn's
output is far shorter). The ``uniform`` form states a length without carrying the values,
so without a bound a 12-byte map could announce 2**64 tokens that no reader can lay out."""
MAX_CHUNKS = 256
"""At most this many chunk records per trajectory (a reader buffers a trajectory's chunks
until the last arrives: this bounds that memory at ``MAX_CHUNKS`` x the record limit)."""
SCHEMA_HEADER = "prm-schema-version"
KIND_HEADER = "prm-kind"

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


# --------------------------------------------------------------------------- errors
class SchemaError(WireError, ValueError):
    """A Kafka record could not be turned into one of our messages."""


class UnknownSchemaVersion(SchemaError):
    """The record's schema-version header is missing or names a version we cannot read."""


class UnknownMessageKind(SchemaError):
    """The record's kind header is missing or names no message type we know."""


class InvalidMessage(SchemaError):
    """The bytes are not valid msgpack, or the decoded message breaks a schema rule."""


class ExperimentMismatch(InvalidMessage):
    """A message names another experiment than the topic it is published to (or arrived on).

    The topic is the tenant: a record's experiment is its topic's, so a producer allowed
    on one topic can never reach another experiment's groups, verdicts or metrics. The
    publisher refuses such a message before sending it; a worker dead-letters one that
    arrives (:func:`check_channel`, the one rule for both)."""


# --------------------------------------------------------------------------- arrays
def pack_array(values: Any, dtype: np.dtype) -> bytes:
    """Pack a sequence / numpy array / torch tensor as little-endian bytes of ``dtype``."""
    if isinstance(values, (bytes, bytearray, memoryview)):
        return bytes(values)
    if hasattr(values, "detach"):  # torch.Tensor, without importing torch
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise SchemaError(f"expected a 1-D array, got shape {arr.shape}")
    if dtype == _I32 and arr.size:
        if arr.dtype.kind not in "iu":
            raise SchemaError(f"token ids must be integers, got dtype {arr.dtype}")
        # astype would silently wrap ids outside int32; refuse them (and negative ones) instead.
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise SchemaError(f"token ids must be non-negative int32 (0..{MAX_TOKEN_ID}), got range [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _view(raw: bytes, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(raw, dtype=dtype)  # read-only view over immutable bytes


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """Zero-copy torch view of a read-only array from this module (do not write to it)."""
    import torch

    if array.size == 0:
        return torch.empty(0, dtype=torch.from_numpy(np.empty(0, array.dtype)).dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(array, dtype=torch.from_numpy(np.empty(0, array.dtype)).dtype)


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise SchemaError(f"{name} must be finite, got {value!r}")


# --------------------------------------------------------------------------- trajectories
class ModelResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One generation: prompt tokens in, output tokens (and their log-probs) out.

    The packed bytes are the fields; ``input_tokens``, ``output_tokens`` and
    ``output_logprobs`` are numpy views over them (AReaL's attribute names).
    Build one from arrays with :meth:`from_arrays`.
    """

    input_tokens_raw: bytes = msgspec.field(name="input_tokens")
    output_tokens_raw: bytes = msgspec.field(name="output_tokens")
    output_logprobs_raw: bytes | None = msgspec.field(default=None, name="output_logprobs")
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        if len(self.input_tokens_raw) % 4:
            raise SchemaError("input_tokens: byte length is not a multiple of 4 (int32)")
        if len(self.output_tokens_raw) % 4:
            raise SchemaError("output_tokens: byte length is not a multiple of 4 (int32)")
        for name, raw in (("input_tokens", self.input_tokens_raw), ("output_tokens", self.output_tokens_raw)):
            if raw and int(_view(raw, _I32).min()) < 0:
                raise SchemaError(f"{name}: token ids must be non-negative (a vocabulary index)")
        if self.output_logprobs_raw is not None and len(self.output_logprobs_raw) != len(self.output_tokens_raw):
            raise SchemaError(
                f"output_logprobs: {len(self.output_logprobs_raw) // 4} values for "
                f"{len(self.output_tokens_raw) // 4} output tokens"
            )

    @classmethod
    def from_arrays(
        cls,
        input_tokens: Any,
        output_tokens: Any,
        output_logprobs: Any | None = None,
        stop_reason: str | None = "stop",
    ) -> ModelResponse:
        return cls(
            input_tokens_raw=pack_array(input_tokens, _I32),
            output_tokens_raw=pack_array(output_tokens, _I32),
            output_logprobs_raw=None if output_logprobs is None else pack_array(output_logprobs, _F32),
            stop_reason=stop_reason,
        )

    @property
    def input_tokens(self) -> np.ndarray:
        return _view(self.input_tokens_raw, _I32)

    @property
    def output_tokens(self) -> np.ndarray:
        return _view(self.output_tokens_raw, _I32)

    @property
    def output_logprobs(self) -> np.ndarray | None:
        raw = self.output_logprobs_raw
        return None if raw is None else _view(raw, _F32)

    @property
    def input_len(self) -> int:
        return len(self.input_tokens_raw) // 4

    @property
    def output_len(self) -> int:
        return len(self.output_tokens_raw) // 4


class Interaction(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One turn of a session: the conversation so far, the model's output, its tokens.

    In the compact form (schema version 2) a turn repeats nothing of its parent:
    ``shared_messages`` leading messages of its conversation are the parent's
    ``messages`` + ``output_message_list`` (that many of them) and ``messages`` holds
    the rest; ``shared_tokens`` leading prompt tokens are the parent's input + output
    tokens and ``model_response.input_tokens`` holds the rest. Both are 0 (left out) in
    the full form. Readers never see them: :func:`decode_message` expands.
    """

    interaction_id: WireId
    parent_id: str | None = None  # one of the trajectory's interaction ids (the tree check): their grammar
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    output_message_list: list[dict[str, Any]] = msgspec.field(default_factory=list)
    reward: float | None = None
    model_response: ModelResponse | None = None
    token_rewards_raw: bytes | None = msgspec.field(default=None, name="token_rewards")
    """Optional pre-existing per-output-token rewards (packed float32), e.g. from the
    environment. Scorers' contributions are added to them (AReaL's ``token_rewards``);
    the runner checks their length against ``output_len`` and their finiteness, so a bad
    array rejects the session with a reason instead of dead-lettering the record.
    Omitted when absent, so records without it encode byte for byte as before."""
    shared_messages: int = 0
    shared_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.interaction_id:
            raise SchemaError("interaction_id must be a non-empty string")
        if self.shared_messages or self.shared_tokens:
            if self.shared_messages < 0 or self.shared_tokens < 0:
                raise SchemaError(f"interaction {self.interaction_id!r}: shared_messages/shared_tokens must be >= 0")
            if self.parent_id is None:
                raise SchemaError(
                    f"interaction {self.interaction_id!r}: a root shares nothing with a parent "
                    "(shared_messages/shared_tokens must be 0)"
                )
            if self.shared_tokens and self.model_response is None:
                raise SchemaError(f"interaction {self.interaction_id!r}: shared_tokens without a model_response")
        if self.reward is not None:
            _check_finite(f"interaction {self.interaction_id!r}: reward", self.reward)
        if self.token_rewards_raw is not None and len(self.token_rewards_raw) % 4:
            raise SchemaError(
                f"interaction {self.interaction_id!r}: token_rewards byte length is not a multiple of 4 (float32)"
            )

    @property
    def token_rewards(self) -> np.ndarray | None:
        """Pre-existing token rewards as a read-only float32 view, or None."""
        raw = self.token_rewards_raw
        return None if raw is None else _view(raw, _F32)


class ReadyTrajectory(msgspec.Struct, frozen=True, kw_only=True, tag="ready", tag_field="kind"):
    """One exported session: the unit a scoring worker consumes.

    ``trajectory_id`` is globally unique and is the idempotency key; ``group_id`` /
    ``group_size`` say which GRPO group it belongs to and how many members to expect.
    ``outcome_reward`` is raw (before any group normalization).
    """

    trajectory_id: WireId
    session_id: WireId
    group_id: WireId
    group_size: int
    interactions: list[Interaction]
    outcome_reward: float
    is_eval: bool = False
    policy_version: int | None = None
    created_at: float = 0.0
    experiment_id: ExperimentId | msgspec.UnsetType = msgspec.UNSET
    """The experiment the group belongs to (docs/fleet.md); left out of the record for the
    default experiment, so a default record keeps its version-1 bytes. Read :attr:`experiment`.
    Never the record's identity: its experiment is the topic it arrives on, and a record that
    names another one is refused (:func:`check_channel`)."""

    def __post_init__(self) -> None:
        _check_member(self.trajectory_id, self.session_id, self.group_id, self.group_size, self.experiment_id)
        _check_finite("outcome_reward", self.outcome_reward)
        if not self.interactions:
            raise SchemaError("interactions must not be empty")
        try:
            topological_order(self.interactions)
        except TreeError as exc:
            raise SchemaError(f"interactions: {exc}") from None

    @property
    def experiment(self) -> str:
        """``experiment_id``, or ``"default"`` when the record names none."""
        return _experiment(self.experiment_id)

    @property
    def is_compact(self) -> bool:
        """True when some interaction stores only its delta (needs schema version 2 on the wire)."""
        return any(i.shared_messages or i.shared_tokens for i in self.interactions)


class DiscardGroup(msgspec.Struct, frozen=True, kw_only=True, tag="discard", tag_field="kind"):
    """Explicit request to drop a group: its members are not scored, its verdict is ``discarded``."""

    group_id: WireId
    reason: str = ""
    requested_at: float = 0.0
    experiment_id: ExperimentId | msgspec.UnsetType = msgspec.UNSET
    """As :attr:`ReadyTrajectory.experiment_id`."""

    def __post_init__(self) -> None:
        if not self.group_id:
            raise SchemaError("group_id must be a non-empty string")
        _check_experiment(self.experiment_id)

    @property
    def experiment(self) -> str:
        """``experiment_id``, or ``"default"`` when the record names none."""
        return _experiment(self.experiment_id)


class TrajectoryChunk(msgspec.Struct, frozen=True, kw_only=True, tag="chunk", tag_field="kind"):
    """One piece of a ``ready`` record too large for one Kafka message (schema version 2).

    ``data`` of chunks ``0 .. count-1`` concatenated is the msgpack value of the whole
    (compact) ``ready`` message, ``total_bytes`` long. The chunks of one trajectory share
    its record key (``group_id``), so they land in one partition in order; a worker
    buffers them and scores the trajectory when the last one arrives, committing the
    chunks' offsets only then (see :mod:`infra.chunks`).
    """

    group_id: WireId
    trajectory_id: WireId
    index: int
    count: int
    total_bytes: int
    data: memoryview
    """Decoded as a zero-copy view of the record value (a chunk is only ever joined)."""

    def __post_init__(self) -> None:
        for name in ("group_id", "trajectory_id"):
            if not getattr(self, name):
                raise SchemaError(f"{name} must be a non-empty string")
        if not 2 <= self.count <= MAX_CHUNKS:
            raise SchemaError(f"chunk count must be in [2, {MAX_CHUNKS}], got {self.count}")
        if not 0 <= self.index < self.count:
            raise SchemaError(f"chunk index must be in [0, {self.count - 1}], got {self.index}")
        if not self.data or len(self.data) > self.total_bytes:
            raise SchemaError(f"chunk data must hold 1..total_bytes={self.total_bytes} bytes, got {len(self.data)}")


class SessionTurn(msgspec.Struct, frozen=True, kw_only=True, tag="turn", tag_field="kind"):
    """One interaction of a *streamed* session, sent as soon as the agent produced it.

    A session may arrive whole (``ready``) or as ``turn`` records followed by one
    ``end`` (:class:`SessionEnd`); both forms describe the same
    :class:`ReadyTrajectory` (:func:`streamed_trajectory`), and a worker gives both the
    same verdict. ``interaction`` is exactly one element of a ready trajectory's
    ``interactions``: its ``parent_id`` names an *earlier* turn of the same session
    (any one: branching is allowed), and in the compact form (schema version 2) its
    ``shared_messages`` / ``shared_tokens`` count what it repeats of that parent's
    context, exactly as inside a compact ``ready`` record. The other fields repeat the
    session's identity on every record, so each turn is routed on its own; they must
    agree across the session's records (the worker rejects the session otherwise).
    """

    trajectory_id: str
    session_id: str
    group_id: str
    group_size: int
    interaction: Interaction
    created_at: float = 0.0
    """Unix seconds when the producer sent the turn (latency accounting only)."""
    experiment_id: str | msgspec.UnsetType = msgspec.UNSET
    """As :attr:`ReadyTrajectory.experiment_id`."""

    def __post_init__(self) -> None:
        _check_member(self.trajectory_id, self.session_id, self.group_id, self.group_size, self.experiment_id)

    @property
    def experiment(self) -> str:
        """``experiment_id``, or ``"default"`` when the record names none."""
        return _experiment(self.experiment_id)

    @property
    def is_compact(self) -> bool:
        """True when the interaction stores only its delta (schema version 2 on the wire)."""
        return bool(self.interaction.shared_messages or self.interaction.shared_tokens)


class SessionEnd(msgspec.Struct, frozen=True, kw_only=True, tag="end", tag_field="kind"):
    """The end of a streamed session: the session-level fields of ``ready``.

    Sent after the session's last ``turn`` (same record key, so it is read after them).
    ``turn_count``, when given, is the number of distinct turns the session sent: a
    worker that holds another number rejects the member (``invalid_member``) instead of
    scoring a session with a lost turn.
    """

    trajectory_id: str
    session_id: str
    group_id: str
    group_size: int
    outcome_reward: float
    is_eval: bool = False
    policy_version: int | None = None
    created_at: float = 0.0
    turn_count: int | None = None
    experiment_id: str | msgspec.UnsetType = msgspec.UNSET
    """As :attr:`ReadyTrajectory.experiment_id`."""

    def __post_init__(self) -> None:
        _check_member(self.trajectory_id, self.session_id, self.group_id, self.group_size, self.experiment_id)
        _check_finite("outcome_reward", self.outcome_reward)
        if self.turn_count is not None and self.turn_count < 1:
            raise SchemaError(f"turn_count must be >= 1, got {self.turn_count}")

    @property
    def experiment(self) -> str:
        """``experiment_id``, or ``"default"`` when the record names none."""
        return _experiment(self.experiment_id)


def _check_member(
    trajectory_id: str, session_id: str, group_id: str, group_size: int, experiment_id: str | msgspec.UnsetType
) -> None:
    for name, value in (("trajectory_id", trajectory_id), ("session_id", session_id), ("group_id", group_id)):
        if not value:
            raise SchemaError(f"{name} must be a non-empty string")
    _check_experiment(experiment_id)
    if group_size < 1:
        raise SchemaError(f"group_size must be >= 1, got {group_size}")


def streamed_trajectory(turns: Sequence[Interaction], end: SessionEnd) -> ReadyTrajectory:
    """The ``ready`` form of a streamed session: its turns in arrival order (compact as
    they came, expand with :func:`expand_trajectory`) and the ``end``'s session fields.

    This is the one definition of "the same session": a worker scores what this returns,
    so a streamed session and the ``ready`` record of the same turns get the same
    verdict. Raises :class:`InvalidMessage` when the turns do not form a session (no
    turn, a repeated id, a parent that is not an earlier turn, a compact turn sharing
    more than its parent's context) or their number differs from ``end.turn_count``.
    """
    if end.turn_count is not None and end.turn_count != len(turns):
        raise InvalidMessage(f"session {end.session_id!r}: the end says {end.turn_count} turns, {len(turns)} arrived")
    seen: set[str] = set()
    for turn in turns:
        if turn.parent_id is not None and turn.parent_id not in seen:
            raise InvalidMessage(
                f"session {end.session_id!r}: turn {turn.interaction_id!r} names parent "
                f"{turn.parent_id!r}, which is not an earlier turn of the session"
            )
        if turn.interaction_id in seen:
            raise InvalidMessage(f"session {end.session_id!r}: turn id {turn.interaction_id!r} is repeated")
        seen.add(turn.interaction_id)
    try:
        traj = ReadyTrajectory(
            trajectory_id=end.trajectory_id,
            session_id=end.session_id,
            group_id=end.group_id,
            group_size=end.group_size,
            interactions=list(turns),
            outcome_reward=end.outcome_reward,
            is_eval=end.is_eval,
            policy_version=end.policy_version,
            created_at=end.created_at,
            experiment_id=end.experiment_id,
        )
    except SchemaError as exc:
        raise InvalidMessage(f"session {end.session_id!r}: {exc}") from None
    check_expandable(traj)
    return traj


def stream_session(traj: ReadyTrajectory) -> tuple[list[SessionTurn], SessionEnd]:
    """A ready trajectory as a streamed session: one ``turn`` per interaction (full form,
    parents first: the trajectory's own order when it already is) and its ``end``.
    The inverse of :func:`streamed_trajectory`, for producers that hold whole sessions
    and for tests that compare both forms."""
    seen: set[str] = set()
    order = traj.interactions
    for it in order:
        if it.parent_id is not None and it.parent_id not in seen:
            order = topological_order(traj.interactions)
            break
        seen.add(it.interaction_id)
    member: dict[str, Any] = {
        "trajectory_id": traj.trajectory_id,
        "session_id": traj.session_id,
        "group_id": traj.group_id,
        "group_size": traj.group_size,
        "experiment_id": traj.experiment_id,
    }
    full = expand_trajectory_interactions(order)
    turns = [SessionTurn(interaction=it, created_at=traj.created_at, **member) for it in full]
    end = SessionEnd(
        outcome_reward=traj.outcome_reward,
        is_eval=traj.is_eval,
        policy_version=traj.policy_version,
        created_at=traj.created_at,
        turn_count=len(turns),
        **member,
    )
    return turns, end


TrajectoryMessage = ReadyTrajectory | DiscardGroup | TrajectoryChunk | SessionTurn | SessionEnd
TRAJECTORY_KINDS = ("ready", "discard", "chunk")
"""The kinds every reader of the trajectories topic decodes (:func:`decode_message`'s default)."""
STREAM_KINDS = ("turn", "end")
"""The kinds of a streamed session: only readers that park turns ask for them."""
ALL_KINDS = TRAJECTORY_KINDS + STREAM_KINDS
"""Every kind of the trajectories topic (readers of every record: the audit, the dead-letter tool)."""


def _check_experiment(experiment_id: str | msgspec.UnsetType) -> None:
    if experiment_id is not msgspec.UNSET:
        check_experiment_id(experiment_id)


def _experiment(experiment_id: str | msgspec.UnsetType) -> str:
    return DEFAULT_EXPERIMENT if experiment_id is msgspec.UNSET else experiment_id


def check_channel(message: TrajectoryMessage, experiment_id: str, topic: str, *, fix: str = "") -> None:
    """Raise :class:`ExperimentMismatch` when ``message`` names an experiment other than
    ``experiment_id``, the experiment whose trajectories topic ``topic`` is.

    A message that names none belongs to its topic's experiment; a chunk names none (its
    reassembled trajectory is checked). ``fix`` ends the message (what the sender should do;
    ``{named}`` stands for the experiment the message names)."""
    named = getattr(message, "experiment_id", msgspec.UNSET)
    if named is msgspec.UNSET or named == experiment_id:
        return
    what = (
        f"discard of group {message.group_id!r}"
        if isinstance(message, DiscardGroup)
        else f"{kind_of(message)} of trajectory {message.trajectory_id!r}"
    )
    raise ExperimentMismatch(
        f"{what} names experiment {named!r}, but {topic} is the topic of experiment "
        f"{experiment_id!r}: a record's experiment is the topic it is published to"
        f"{fix.format(named=named)}"
    )


# --------------------------------------------------------------------------- scoring results
ObservationScope = Literal["turn", "trajectory"]
ObservationType = Literal["float", "boolean"]
_ALLOWED_AGGREGATIONS = {"boolean": ("count", "rate"), "float": ("sum", "mean")}
_VALID_SPECS: set[tuple[str, str, tuple[str, ...]]] = set()  # (scope, value_type, aggregations) seen valid


def _spec_key(scope: object, value_type: object, aggregations: object) -> tuple[str, str, tuple[str, ...]] | None:
    """The cache key of a checked observation shape, or None when it cannot be one (not all
    plain strings): only plain-string tuples are remembered, so a lookup by equality finds
    exactly the shapes a full check accepted."""
    if (
        type(scope) is str
        and type(value_type) is str
        and type(aggregations) is tuple
        and all(type(a) is str for a in aggregations)
    ):
        return (scope, value_type, aggregations)
    return None


class PRMMetricObservation(msgspec.Struct, frozen=True, kw_only=True):
    """A structured, unweighted monitoring value a scorer attaches to its result.

    Boolean observations aggregate as ``count``/``rate``, float ones as ``sum``/``mean``.
    """

    metric_id: str
    scope: ObservationScope
    target_id: str
    value: bool | float
    value_type: ObservationType
    aggregations: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.metric_id:
            raise SchemaError("metric_id must be a non-empty string")
        try:  # a (scope, type, aggregations) combination already checked: only the value is left
            known = (self.scope, self.value_type, self.aggregations) in _VALID_SPECS
        except TypeError:  # unhashable aggregations (a list): checked in full below
            known = False
        if known:  # every scored turn carries observations; the combinations are few
            self._check_value()
            return
        if self.scope not in ("turn", "trajectory"):
            raise SchemaError(f"scope must be 'turn' or 'trajectory', got {self.scope!r}")
        if self.value_type not in _ALLOWED_AGGREGATIONS:
            raise SchemaError(f"value_type must be 'float' or 'boolean', got {self.value_type!r}")
        allowed = _ALLOWED_AGGREGATIONS[self.value_type]
        if not self.aggregations:
            raise SchemaError(f"metric {self.metric_id!r}: aggregations must not be empty")
        if len(set(self.aggregations)) != len(self.aggregations):
            raise SchemaError(f"metric {self.metric_id!r}: duplicate aggregations {self.aggregations}")
        bad = [a for a in self.aggregations if a not in allowed]
        if bad:
            raise SchemaError(
                f"metric {self.metric_id!r}: {self.value_type} observations allow {'/'.join(allowed)}, not {bad}"
            )
        self._check_value()
        if (spec := _spec_key(self.scope, self.value_type, self.aggregations)) is not None and len(_VALID_SPECS) < 1024:
            _VALID_SPECS.add(spec)

    def _check_value(self) -> None:
        if self.value_type == "boolean":
            if not isinstance(self.value, bool):
                raise SchemaError(f"metric {self.metric_id!r}: boolean value must be a bool")
        else:
            if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
                raise SchemaError(f"metric {self.metric_id!r}: float value must be an int or float")
            _check_finite(f"metric {self.metric_id!r}: value", float(self.value))


class PRMTurnResult(msgspec.Struct, frozen=True, kw_only=True):
    """One scorer's result for one turn of one branch (AReaL's typed ``prm_stats``).

    ``reward`` is the mean of the scorer's *weighted* token rewards for the turn.
    """

    interaction_id: str  # per-turn ids of results: see BranchResult
    scorer_name: str
    reward: float
    observations: tuple[PRMMetricObservation, ...] = ()


class TokenRewards(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-token rewards of one turn; ``uniform`` when every token has the same value."""

    length: int
    uniform: float | None = None
    values_raw: bytes | None = msgspec.field(default=None, name="values")

    def __post_init__(self) -> None:
        if not 0 <= self.length <= MAX_TURN_TOKENS:
            raise SchemaError(f"token rewards: length must be >= 0 and <= {MAX_TURN_TOKENS}, got {self.length}")
        if (self.uniform is None) == (self.values_raw is None):
            raise SchemaError("token rewards need exactly one of 'uniform' and 'values'")
        if self.uniform is not None:
            _check_finite("token rewards: uniform", self.uniform)
        if self.values_raw is not None:
            if len(self.values_raw) != 4 * self.length:
                raise SchemaError(f"token rewards: {len(self.values_raw) // 4} values for length {self.length}")
            if not np.isfinite(_view(self.values_raw, _F32)).all():
                raise SchemaError("token rewards: values must be finite")

    @classmethod
    def from_array(cls, values: Any) -> TokenRewards:
        arr = np.ascontiguousarray(values.detach().cpu().numpy() if hasattr(values, "detach") else values, dtype=_F32)
        if arr.size and bool((arr == arr[0]).all()):
            return cls(length=int(arr.size), uniform=float(arr[0]))
        return cls(length=int(arr.size), values_raw=arr.tobytes())

    def to_numpy(self) -> np.ndarray:
        if self.values_raw is not None:
            return _view(self.values_raw, _F32)
        return np.full(self.length, self.uniform, dtype=_F32)


class BranchResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Scores of one root-to-leaf branch: ``path`` lists its interaction ids root first.

    ``token_rewards`` is the weighted sum over scorers. ``channels`` optionally keeps
    each scorer's own weighted token rewards (scorer -> interaction id -> rewards),
    written only when the worker runs with ``worker.keep_scorer_channels``: a trainer
    that combines signals (e.g. a judge's turn scores gating an OPD teacher's token
    signal, :mod:`shaper.combined`) cannot take the sum apart again. The field is
    omitted when empty, so verdicts without channels encode byte for byte as before
    and older readers ignore it.

    Its ids (and those of :class:`PRMTurnResult` and :class:`TokenTurn`, one per turn) are
    plain strings, not :data:`infra.ids.WireId`: workers write them from interaction ids
    that passed the grammar when their trajectory was decoded, and only workers write
    verdicts and parked results (docs/security.md). Checking every turn's ids again cost
    3 % of a worker's CPU (its ledger reads parked results back) and 8 % of a trainer's
    per trajectory in a 16-turn ``bench capacity``; the group's, members' and scorers'
    ids keep the grammar.
    """

    leaf_id: str
    path: list[str]
    token_rewards: dict[str, TokenRewards]
    scorer_totals: dict[str, float]
    channels: dict[str, dict[str, TokenRewards]] = msgspec.field(default_factory=dict)


class TokenTurn(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One turn of a concat-export session, stored without repeating its history.

    In concat export a turn's input is its parent's input + output + ``prompt_delta``
    (for a root, the delta is the whole prompt). Verdicts carry these instead of full
    interactions: O(total tokens) instead of O(turns^2) bytes, and the trainer rebuilds
    every sequence exactly with :func:`expand_turns`.
    """

    interaction_id: str  # as BranchResult's ids
    parent_id: str | None = None
    prompt_delta_raw: bytes = msgspec.field(default=b"", name="prompt_delta")
    output_tokens_raw: bytes = msgspec.field(default=b"", name="output_tokens")
    output_logprobs_raw: bytes | None = msgspec.field(default=None, name="output_logprobs")
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        if len(self.prompt_delta_raw) % 4 or len(self.output_tokens_raw) % 4:
            raise SchemaError(f"turn {self.interaction_id!r}: token bytes are not a multiple of 4 (int32)")
        if self.output_logprobs_raw is not None and len(self.output_logprobs_raw) != len(self.output_tokens_raw):
            raise SchemaError(f"turn {self.interaction_id!r}: output_logprobs length differs from output_tokens")

    @property
    def prompt_delta(self) -> np.ndarray:
        """The new prompt tokens (int32, read-only view)."""
        return _view(self.prompt_delta_raw, _I32)

    @property
    def output_tokens(self) -> np.ndarray:
        """The generated tokens (int32, read-only view)."""
        return _view(self.output_tokens_raw, _I32)

    @property
    def output_logprobs(self) -> np.ndarray | None:
        """Behaviour log-probs of the generated tokens (float32, read-only view), or None."""
        raw = self.output_logprobs_raw
        return None if raw is None else _view(raw, _F32)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens_raw) // 4


class NotConcatExport(WireError, ValueError):
    """A turn's input does not start with its parent's input + output.

    ``reason`` is ``not_prefix`` or ``not_token_backed``, ``interaction_id`` the turn, and
    ``detail`` says what differs (the message without the turn's name).
    """

    def __init__(self, interaction_id: str, detail: str, *, reason: str = "not_prefix") -> None:
        super().__init__(f"interaction {interaction_id!r}: {detail}")
        self.interaction_id, self.detail, self.reason = interaction_id, detail, reason

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (a process pool) with its fields
        return type(self), (self.interaction_id, self.detail), {"reason": self.reason}


def _prefix_mismatch(parent_id: str, parent: ModelResponse, child: ModelResponse) -> str:
    """Why ``child``'s input does not start with ``parent``'s input + output (first differing token)."""
    p_in, p_out, c_in = parent.input_tokens, parent.output_tokens, child.input_tokens
    where = f"input does not start with parent {parent_id!r}'s input + output (concat export required)"
    if c_in.shape[0] < p_in.shape[0] + p_out.shape[0]:
        return (
            f"{where}: input has {c_in.shape[0]} tokens, fewer than its parent's input + output "
            f"({p_in.shape[0]} + {p_out.shape[0]})"
        )
    for what, expected, start in (("input", p_in, 0), ("output", p_out, p_in.shape[0])):
        got = c_in[start : start + expected.shape[0]]
        diff = np.flatnonzero(got != expected)
        if diff.size:
            pos = int(diff[0])
            return (
                f"{where}: token {start + pos} is {int(got[pos])}, the parent's {what} token {pos} is "
                f"{int(expected[pos])} (was the chat template re-applied?)"
            )
    return where


def _turns_of_compact(interactions: Sequence[Interaction]) -> list[TokenTurn] | None:
    """:func:`compact_turns` of a compact trajectory whose every child shares its parent's
    whole context (``shared_tokens``): concat export by construction, so each turn's delta
    is its stored prompt and nothing is compared. None when that does not hold (the
    full check decides)."""
    if not any(i.shared_tokens for i in interactions):
        return None
    ctx: dict[str, int] = {}
    turns: list[TokenTurn] = []
    for it in topological_order(interactions):
        mr = it.model_response
        if mr is None:
            return None
        if it.parent_id is None:
            if it.shared_tokens:
                return None
        elif it.shared_tokens != ctx[it.parent_id]:
            return None
        ctx[it.interaction_id] = it.shared_tokens + mr.input_len + mr.output_len
        turns.append(
            TokenTurn(
                interaction_id=it.interaction_id,
                parent_id=it.parent_id,
                prompt_delta_raw=mr.input_tokens_raw,
                output_tokens_raw=mr.output_tokens_raw,
                output_logprobs_raw=mr.output_logprobs_raw,
                stop_reason=mr.stop_reason,
            )
        )
    return turns


def compact_turns(interactions: Sequence[Interaction]) -> list[TokenTurn]:
    """Token-backed interactions -> :class:`TokenTurn`s, checking the concat-export prefix rule.

    Compact interactions (the wire form) in which every child shares its parent's whole
    context need no check at all. Otherwise linear in the session for expanded
    trajectories: a child's prompt and its parent's are views of one buffer, so the
    prefix check is an address comparison (:func:`infra.prefix.same_bytes`).
    """
    fast = _turns_of_compact(interactions)
    if fast is not None:
        return fast
    interactions = expand_trajectory_interactions(interactions)
    by_id = {i.interaction_id: i for i in interactions}
    turns: list[TokenTurn] = []
    for it in topological_order(interactions):
        mr = it.model_response
        if mr is None:
            raise NotConcatExport(
                it.interaction_id, "has no model_response (not token-backed)", reason="not_token_backed"
            )
        start = 0
        raw = memoryview(mr.input_tokens_raw)
        if it.parent_id is not None:
            parent = by_id[it.parent_id].model_response
            assert parent is not None  # checked when the parent was visited
            start = parent.input_len + parent.output_len
            if (
                mr.input_len < start
                or not same_bytes(raw[: 4 * parent.input_len], parent.input_tokens_raw)
                or not same_bytes(raw[4 * parent.input_len : 4 * start], parent.output_tokens_raw)
            ):
                raise NotConcatExport(it.interaction_id, _prefix_mismatch(it.parent_id, parent, mr))
        # An expanded prompt is a view of its chain's buffer: its delta is a view too. A
        # full-form prompt is copied, so the turn does not pin its whole prompt.
        delta = raw[4 * start :] if isinstance(mr.input_tokens_raw, memoryview) else bytes(raw[4 * start :])
        turns.append(
            TokenTurn(
                interaction_id=it.interaction_id,
                parent_id=it.parent_id,
                prompt_delta_raw=delta,
                output_tokens_raw=mr.output_tokens_raw,
                output_logprobs_raw=mr.output_logprobs_raw,
                stop_reason=mr.stop_reason,
            )
        )
    return turns


def expand_turns(turns: Sequence[TokenTurn]) -> list[Interaction]:
    """Rebuild token-backed interactions (full input tokens) from :func:`compact_turns` output.

    The same expansion as a compact ``ready`` record's (:func:`infra.prefix.expand_prompts`):
    a turn shares its parent's whole context. Input tokens are read-only memoryviews
    over one buffer per chain (memory linear in the session).
    """
    order = topological_order(turns)
    ctx_len: dict[str, int] = {}
    parts = []
    for t in order:
        shared = 0 if t.parent_id is None else ctx_len[t.parent_id]
        ctx_len[t.interaction_id] = shared + (len(t.prompt_delta_raw) + len(t.output_tokens_raw)) // 4
        parts.append(Part(t.interaction_id, t.parent_id, shared, t.prompt_delta_raw, t.output_tokens_raw))
    prompts = expand_prompts(parts)
    return [
        Interaction(
            interaction_id=t.interaction_id,
            parent_id=t.parent_id,
            model_response=ModelResponse(
                input_tokens_raw=prompts[t.interaction_id],  # type: ignore[arg-type]  # a read-only view
                output_tokens_raw=t.output_tokens_raw,
                output_logprobs_raw=t.output_logprobs_raw,
                stop_reason=t.stop_reason,
            ),
        )
        for t in order
    ]


# --------------------------------------------------------------------------- compact trajectories
def expand_trajectory_interactions(interactions: Sequence[Interaction]) -> list[Interaction]:
    """Full-form interactions from compact (or full) ones, in the same order.

    Raises ``ValueError`` when a turn shares more than its parent's context holds. Full
    interactions come back as they are (the same objects).
    """
    if not any(i.shared_messages or i.shared_tokens for i in interactions):
        return list(interactions)
    order = topological_order(interactions)
    messages = expand_messages(
        [Part(i.interaction_id, i.parent_id, i.shared_messages, i.messages, i.output_message_list) for i in order]
    )
    empty = b""
    prompts = expand_prompts(
        [
            Part(
                i.interaction_id,
                i.parent_id,
                i.shared_tokens,
                i.model_response.input_tokens_raw if i.model_response is not None else empty,
                i.model_response.output_tokens_raw if i.model_response is not None else empty,
            )
            for i in order
        ]
    )
    out = []
    for i in interactions:
        mr = i.model_response
        if mr is not None:
            # Not checked again (``replace`` would): the whole prompt is the parent's context,
            # its output and this turn's own tokens, each checked when it was decoded; a long
            # session's prompts would be scanned once per turn, the square of its length.
            mr = copy.copy(mr)
            msgspec.structs.force_setattr(mr, "input_tokens_raw", prompts[i.interaction_id])
        out.append(
            msgspec.structs.replace(
                i, messages=messages[i.interaction_id], model_response=mr, shared_messages=0, shared_tokens=0
            )
        )
    return out


def expand_trajectory(traj: ReadyTrajectory) -> ReadyTrajectory:
    """The full form of a compact trajectory (the same object when it is already full).

    Every turn gets its whole conversation (the message dicts are shared between turns,
    not copied) and its whole prompt (read-only memoryviews over one buffer per chain
    of turns), so memory stays linear in the session.
    """
    if not traj.is_compact:
        return traj
    # Same ids and parent links: the tree was checked when ``traj`` was built, so the
    # copy is not validated again (msgspec.structs.replace would re-run __post_init__).
    out = copy.copy(traj)
    msgspec.structs.force_setattr(out, "interactions", expand_trajectory_interactions(traj.interactions))
    return out


def check_expandable(traj: ReadyTrajectory) -> None:
    """Raise :class:`InvalidMessage` when a compact trajectory cannot be expanded (a turn
    shares more messages or tokens than its parent's context holds) — the check
    :func:`decode_message` makes by expanding, without building anything (length
    arithmetic only), for readers that expand later (the worker scores the expanded form
    but takes its token turns from the compact one)."""
    if not traj.is_compact:
        return
    msgs: dict[str, int] = {}
    toks: dict[str, int] = {}
    for i in topological_order(traj.interactions):
        mr = i.model_response
        n_in = i.shared_tokens + (mr.input_len if mr is not None else 0)
        n_msgs = i.shared_messages + len(i.messages)
        if i.parent_id is not None:
            for shared, have, unit in (
                (i.shared_messages, msgs[i.parent_id], "messages"),
                (i.shared_tokens, toks[i.parent_id], "tokens"),
            ):
                if shared > have:
                    raise InvalidMessage(
                        f"interactions: turn {i.interaction_id!r}: shares {shared} {unit} with "
                        f"parent {i.parent_id!r}, whose context has only {have}"
                    )
        msgs[i.interaction_id] = n_msgs + len(i.output_message_list)
        toks[i.interaction_id] = n_in + (mr.output_len if mr is not None else 0)


def compact_trajectory(traj: ReadyTrajectory) -> ReadyTrajectory:
    """The compact form: each turn keeps only what follows the prefix it shares with its parent.

    The shared prefix is the longest one (messages compared as values, tokens as ids),
    so a concat-export turn shares its parent's whole context and a turn whose history
    was re-rendered shares what still matches — down to nothing (a full prompt).
    ``expand_trajectory(compact_trajectory(t))`` equals ``t``. A trajectory in which no
    turn shares anything comes back unchanged (and encodes as version 1).
    """
    if traj.is_compact:
        return traj
    by_id = {i.interaction_id: i for i in traj.interactions}
    out = []
    changed = False
    for it in traj.interactions:
        parent = by_id.get(it.parent_id) if it.parent_id is not None else None
        if parent is None:
            out.append(it)
            continue
        sm = shared_list_prefix(parent.messages, parent.output_message_list, it.messages)
        mr, pmr, st = it.model_response, parent.model_response, 0
        if mr is not None and pmr is not None:
            st = shared_token_prefix(pmr.input_tokens_raw, pmr.output_tokens_raw, mr.input_tokens_raw)
        if not sm and not st:
            out.append(it)
            continue
        changed = True
        if st:
            assert mr is not None
            mr = msgspec.structs.replace(mr, input_tokens_raw=bytes(memoryview(mr.input_tokens_raw)[4 * st :]))
        out.append(
            msgspec.structs.replace(
                it, messages=it.messages[sm:], shared_messages=sm, model_response=mr, shared_tokens=st
            )
        )
    return msgspec.structs.replace(traj, interactions=out) if changed else traj


SessionStatus = Literal["scored", "failed", "missing", "discarded", "pending"]


class TokenRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a member's token turns are: its record in the trajectories topic.

    A verdict published with ``worker.verdict_tokens: reference`` (or ``auto``, when the
    verdict would not fit ``kafka.max_message_bytes`` with the turns) carries this instead
    of the member's :class:`TokenTurn` list. ``offset`` is the ``ready`` record's offset,
    or a chunked trajectory's first chunk's (its other chunks follow it on the same
    partition). Readers turn it back into turns with :mod:`infra.readback`, the code the
    worker uses for the same job.
    """

    partition: int
    offset: int


class SessionResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One member's outcome inside a verdict, with everything the trainer needs.

    ``turns`` is the member's token-backed tree in compact form (:class:`TokenTurn`; use
    :func:`expand_turns` for full interactions), so the verdicts topic alone reproduces
    the trainer's batches. A failed member keeps its successful peers'
    ``turn_results``/``stats`` out: it carries none (no partial branch stats).

    A failed member says why in typed fields, so no reader parses ``error``:
    ``error_code`` (a registered reason code, :mod:`infra.reasons`, such as
    ``scorer_timeout``), ``error_scorer`` (the scorer that failed, when one did) and
    ``error_detail`` (the message). ``error`` keeps the human-readable
    ``"code: detail"`` line. Every failure is built with :meth:`failure`, which refuses
    an unregistered code. The typed fields are omitted when unset, so other results
    encode byte for byte as before they existed, and older readers ignore them.
    """

    session_id: WireId
    trajectory_id: WireId
    status: SessionStatus
    outcome_reward: float | None = None
    is_eval: bool = False
    policy_version: int | None = None
    error: str | None = None
    branches: list[BranchResult] = msgspec.field(default_factory=list)
    turn_results: list[PRMTurnResult] = msgspec.field(default_factory=list)
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    turns: list[TokenTurn] = msgspec.field(default_factory=list)
    created_at: float = 0.0
    scored_at: float = 0.0
    error_code: str | None = None
    error_scorer: WireId | None = None
    error_detail: str | None = None

    # Stage timestamps (wall clock, s; 0 = not recorded, omitted on the wire so older
    # encodings are unchanged): the worker took the record from Kafka / parked the result.
    # With ``created_at`` (published), ``scored_at``, the verdict's ``decided_at`` and the
    # verdict record's timestamp (sent) they break a verdict's latency down by stage.
    consumed_at: float = 0.0
    parked_at: float = 0.0
    # ``worker.verdict_tokens: reference`` (or ``auto``, for a verdict too large with the
    # turns): the member's record instead of ``turns``
    # (omitted otherwise, so inline verdicts encode as before it existed).
    tokens_at: TokenRef | None = None
    # A streamed member scored by a worker with ``worker.turn_samples``: each of its turns went
    # out as an online turn sample (``prm.turn-samples``), so a trainer in online mode
    # (``trainer.online_samples``) has trained them already and leaves the member out
    # (omitted when false, so other results encode as before it existed).
    online_samples: bool = False

    @classmethod
    def failure(cls, *, code: str, detail: str, scorer: str | None = None, **fields: Any) -> SessionResult:
        """A ``failed`` member: the typed reason fields plus the ``"code: detail"`` line.

        ``code`` must be a registered member code (:func:`infra.reasons.require`): a
        ``ValueError`` otherwise.
        """
        reasons.require(code, member=True)
        detail = detail[:2000]
        return cls(
            status="failed",
            error=f"{code}: {detail}"[:2000],
            error_code=code,
            error_scorer=scorer,
            error_detail=detail,
            **fields,
        )

    @property
    def failure_code(self) -> str:
        """The failure's reason code: ``error_code``; ``scorer_error`` for a failed member
        built without one (by hand: writers always set it), never parsed from ``error``."""
        return self.error_code or reasons.SCORER_ERROR

    def turn_result_blocks(self) -> list[dict[str, tuple[PRMTurnResult, ...]]] | None:
        """``turn_results`` split per branch: ``[{scorer: results in path order}]``, one per branch.

        The layout, read only here: workers flatten turn results branch by branch in
        ``branches`` order; a branch's block holds, for each scorer of its
        ``scorer_totals`` in config order, one result per turn of its ``path`` in path
        order (``len(path) * len(scorer_totals)`` entries). Scoring off means empty
        blocks. Returns None when the list does not fit (hand-built or corrupt) rather
        than a guess.
        """
        results = self.turn_results
        out: list[dict[str, tuple[PRMTurnResult, ...]]] = []
        pos = 0
        for branch in self.branches:
            n = len(branch.path)
            size = n * len(branch.scorer_totals)
            block = results[pos : pos + size]
            if not n or len(block) != size:
                return None
            by_scorer: dict[str, tuple[PRMTurnResult, ...]] = {}
            for j in range(0, size, n):
                chunk = tuple(block[j : j + n])
                name = chunk[0].scorer_name
                if name in by_scorer or any(
                    tr.scorer_name != name or tr.interaction_id != iid for tr, iid in zip(chunk, branch.path)
                ):
                    return None
                by_scorer[name] = chunk
            out.append(by_scorer)
            pos += size
        return out if pos == len(results) else None


class ScorerInfo(msgspec.Struct, frozen=True):
    name: WireId
    version: str


VerdictStatus = Literal["accepted", "rejected", "discarded"]


class GroupVerdict(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The decision for one group; ``(experiment_id, group_id, verdict_version)`` is the trainer's dedupe key.

    Why, typed: ``reason_code`` is a registered code (:mod:`infra.reasons`; empty when
    accepted) for programs and metric labels, ``reason`` free text for people (a
    discard's own words, a dead letter's coordinates, a failed member's detail). Read
    the code, never parse the text. ``reason_code`` is left out when empty, so a
    verdict written before it existed decodes with ``""``.
    """

    group_id: WireId
    status: VerdictStatus
    reason: str = ""
    verdict_version: int = 1
    group_size: int = 0
    sessions: list[SessionResult] = msgspec.field(default_factory=list)
    scorers: list[ScorerInfo] = msgspec.field(default_factory=list)
    worker_id: str = ""
    decided_at: float = 0.0
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    reason_code: str = ""
    experiment_id: ExperimentId = DEFAULT_EXPERIMENT
    """The experiment of the group (left out when ``"default"``): the trainer's dedupe key is
    ``(experiment_id, group_id, verdict_version)``."""

    def __post_init__(self) -> None:
        check_experiment_id(self.experiment_id)
        if self.reason_code and not reasons.CODE_PATTERN.fullmatch(self.reason_code):
            raise SchemaError(
                f"reason_code {self.reason_code[:80]!r} is not a reason code ({reasons.CODE_PATTERN.pattern})"
            )


class TurnSample(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One judged turn of a streamed session, for an online trainer (OpenClaw-RL's mode).

    Published on ``topics.turn_samples`` (``prm.turn-samples[.<experiment>]``, key: the
    ``session_id``, so a session's samples stay in the order they were judged) as soon as
    the turn's judge result exists — when its next state arrived, long before the session
    ends, which it need never do. The trainer applies OpenClaw-RL's per-session rules
    (:mod:`shaper.online`). ``(experiment_id, trajectory_id, interaction_id)`` is the
    dedupe key: delivery is at-least-once.

    ``score`` is the judge scorer's unweighted turn reward (the vote result, 1/0/-1);
    ``has_next_state`` False with ``last`` True is the session's last turn, sent at its
    ``end`` (no next state: OpenClaw-RL submits it excluded and clears the session's
    count). ``turn`` numbers the session's turns 1, 2, ... in arrival order.
    """

    session_id: str
    trajectory_id: str
    group_id: str
    interaction_id: str
    turn: int
    scorer: str
    score: float
    has_next_state: bool
    prompt_tokens_raw: bytes = msgspec.field(name="prompt_tokens")
    output_tokens_raw: bytes = msgspec.field(name="output_tokens")
    output_logprobs_raw: bytes | None = msgspec.field(default=None, name="output_logprobs")
    last: bool = False
    judged_at: float = 0.0
    worker_id: str = ""
    experiment_id: str = DEFAULT_EXPERIMENT

    def __post_init__(self) -> None:
        for name in ("session_id", "trajectory_id", "group_id", "interaction_id", "scorer"):
            if not getattr(self, name):
                raise SchemaError(f"turn sample: {name} must be a non-empty string")
        check_experiment_id(self.experiment_id)
        if self.turn < 1:
            raise SchemaError(f"turn sample: turn must be >= 1, got {self.turn}")
        _check_finite("turn sample: score", self.score)
        if len(self.prompt_tokens_raw) % 4 or len(self.output_tokens_raw) % 4:
            raise SchemaError("turn sample: token bytes are not a multiple of 4 (int32)")
        if self.output_logprobs_raw is not None and len(self.output_logprobs_raw) != len(self.output_tokens_raw):
            raise SchemaError("turn sample: output_logprobs length differs from output_tokens")

    @property
    def prompt_tokens(self) -> np.ndarray:
        return _view(self.prompt_tokens_raw, _I32)

    @property
    def output_tokens(self) -> np.ndarray:
        return _view(self.output_tokens_raw, _I32)

    @property
    def output_logprobs(self) -> np.ndarray | None:
        raw = self.output_logprobs_raw
        return None if raw is None else _view(raw, _F32)


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A record no worker could process. On the topic, ``payload`` is the record value
    and the other fields are headers (see :func:`dead_letter_headers`)."""

    payload: bytes
    error_class: str
    error_message: str
    source_topic: str
    source_partition: int
    source_offset: int
    attempt: int = 1
    worker_id: str = ""
    original_headers: dict[str, str] = msgspec.field(default_factory=dict)
    original_size: int = -1  # bytes of the original value when ``payload`` was truncated


# --------------------------------------------------------------------------- codecs
Headers = Sequence[tuple[str, bytes]]

_ENCODER = msgspec.msgpack.Encoder()
_MESSAGE_DECODER = msgspec.msgpack.Decoder(TrajectoryMessage)
_VERDICT_DECODER = msgspec.msgpack.Decoder(GroupVerdict)
_SAMPLE_DECODER = msgspec.msgpack.Decoder(TurnSample)


def kind_of(message: TrajectoryMessage | GroupVerdict | TurnSample) -> str:
    if isinstance(message, ReadyTrajectory):
        return "ready"
    if isinstance(message, DiscardGroup):
        return "discard"
    if isinstance(message, TrajectoryChunk):
        return "chunk"
    if isinstance(message, SessionTurn):
        return "turn"
    if isinstance(message, SessionEnd):
        return "end"
    if isinstance(message, GroupVerdict):
        return "verdict"
    if isinstance(message, TurnSample):
        return "turn_sample"
    raise TypeError(f"not a wire message: {type(message).__name__}")


def schema_version_of(message: TrajectoryMessage | GroupVerdict | TurnSample) -> int:
    """The lowest schema version that expresses ``message``: 2 for compact trajectories, compact turns and chunks."""
    if isinstance(message, TrajectoryChunk) or (
        isinstance(message, (ReadyTrajectory, SessionTurn)) and message.is_compact
    ):
        return COMPACT_SCHEMA_VERSION
    return SCHEMA_VERSION


def encode(message: TrajectoryMessage | GroupVerdict | TurnSample) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Encode a message as ``(value, headers)`` for a Kafka record (as it is: compact
    only if it already is, see :func:`compact_trajectory`)."""
    headers = [
        (SCHEMA_HEADER, str(schema_version_of(message)).encode()),
        (KIND_HEADER, kind_of(message).encode()),
    ]
    return _ENCODER.encode(message), headers


def _header(headers: Headers | None, name: str) -> str | None:
    for key, value in headers or ():
        if key == name:
            try:
                return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
            except UnicodeDecodeError:
                return repr(value)
    return None


def _check_headers(headers: Headers | None, expected: Iterable[str]) -> tuple[str, int]:
    version = _header(headers, SCHEMA_HEADER)
    if version is None:
        raise UnknownSchemaVersion(f"missing {SCHEMA_HEADER!r} header")
    # ASCII digits only ("²" is a digit to str.isdigit, not to int()), and short: int() refuses
    # strings over 4,300 digits with a ValueError.
    number = int(version) if version.isascii() and version.isdigit() and len(version) <= 20 else None
    if number not in SUPPORTED_SCHEMA_VERSIONS:
        raise UnknownSchemaVersion(
            f"schema version {_clip(version)} is not supported (this build reads "
            f"{sorted(SUPPORTED_SCHEMA_VERSIONS)}); upgrade the worker or re-publish"
        )
    kind = _header(headers, KIND_HEADER)
    expected = tuple(expected)
    if kind not in expected:
        raise UnknownMessageKind(f"message kind {_clip(kind)} is not one of {list(expected)}")
    assert number is not None
    return kind, number


def _clip(text: str | None, limit: int = 80) -> str:
    """``repr(text)`` for an error message, shortened when a header is long."""
    return repr(text) if text is None or len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _decode(decoder: msgspec.msgpack.Decoder[Any], value: bytes) -> Any:
    try:
        with validating(root=decoder.type, error=InvalidMessage):
            return decoder.decode(value)
    except msgspec.DecodeError as exc:  # not valid msgpack (truncated, malformed)
        raise InvalidMessage(str(exc)) from None
    except RecursionError:  # msgspec recurses once per level (free-form messages can nest)
        raise InvalidMessage(
            "msgpack nested too deeply (arrays/maps inside each other past the recursion limit)"
        ) from None


def decode_message(
    value: bytes | None, headers: Headers | None, *, expand: bool = True, kinds: Sequence[str] = TRAJECTORY_KINDS
) -> TrajectoryMessage:
    """Decode a ``prm.trajectories`` record, raising :class:`SchemaError` subclasses.

    A compact ``ready`` record comes back expanded (full interactions) unless
    ``expand=False`` (the wire form, e.g. to re-encode it byte for byte). A ``chunk``
    comes back as it is: :mod:`infra.chunks` reassembles chunks into a ready record.
    ``kinds`` are the kinds the caller handles (another is :class:`UnknownMessageKind`):
    the batch kinds by default; a reader that parks streamed sessions adds
    :data:`STREAM_KINDS`. A compact ``turn`` always comes back as it is: only the
    session's earlier turns can expand it (:func:`streamed_trajectory`).
    """
    kind, version = _check_headers(headers, kinds)
    if value is None:
        raise InvalidMessage("record has no value (tombstone)")
    message: TrajectoryMessage = _decode(_MESSAGE_DECODER, value)
    if kind_of(message) != kind:
        raise InvalidMessage(f"header says {kind!r} but the payload is {kind_of(message)!r}")
    needed = schema_version_of(message)
    if version < needed:
        what = (
            "a chunk"
            if isinstance(message, TrajectoryChunk)
            else "a compact turn (shared_messages/shared_tokens)"
            if isinstance(message, SessionTurn)
            else "a compact trajectory (shared_messages/shared_tokens)"
        )
        raise InvalidMessage(
            f"{what} needs {SCHEMA_HEADER}: {needed}, the record says {version} (a version-1 reader would misread it)"
        )
    if expand and isinstance(message, ReadyTrajectory) and message.is_compact:
        try:
            message = expand_trajectory(message)
        except ValueError as exc:
            raise InvalidMessage(f"interactions: {exc}") from None
    return message


def decode_verdict(value: bytes | None, headers: Headers | None) -> GroupVerdict:
    """Decode a ``prm.verdicts`` record, raising :class:`SchemaError` subclasses."""
    _check_headers(headers, ("verdict",))  # verdicts are version 1 (any supported version is read)
    if value is None:
        raise InvalidMessage("record has no value (tombstone)")
    verdict: GroupVerdict = _decode(_VERDICT_DECODER, value)
    return verdict


def decode_turn_sample(value: bytes | None, headers: Headers | None) -> TurnSample:
    """Decode a ``prm.turn-samples`` record, raising :class:`SchemaError` subclasses."""
    _check_headers(headers, ("turn_sample",))
    if value is None:
        raise InvalidMessage("record has no value (tombstone)")
    sample: TurnSample = _decode(_SAMPLE_DECODER, value)
    return sample


def dead_letter_headers(letter: DeadLetter) -> list[tuple[str, bytes]]:
    """Headers of a dead-letter record (the value is ``letter.payload``)."""
    fields = {
        "prm-dl-error-class": letter.error_class,
        "prm-dl-error-message": letter.error_message[:4000],
        "prm-dl-source-topic": letter.source_topic,
        "prm-dl-source-partition": str(letter.source_partition),
        "prm-dl-source-offset": str(letter.source_offset),
        "prm-dl-attempt": str(letter.attempt),
        "prm-dl-worker-id": letter.worker_id,
    }
    if letter.original_size >= 0:
        fields["prm-dl-original-size"] = str(letter.original_size)
    headers = [(k, v.encode()) for k, v in fields.items()]
    headers += [(f"prm-dl-orig-{k}", v.encode()) for k, v in letter.original_headers.items()]
    return headers


def dead_letter_from_record(value: bytes | None, headers: Headers) -> DeadLetter:
    """Rebuild a :class:`DeadLetter` from a dead-letter record (for tools and tests).

    Raises:
        InvalidMessage: a numeric header that is not a decimal integer.
    """
    h = {k: (v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)) for k, v in headers}

    def number(name: str, default: str) -> int:
        text = h.get(name, default)
        if not (text.isascii() and text.lstrip("-").isdigit() and len(text) <= 20):
            raise InvalidMessage(f"dead-letter header {name} is not an integer: {text[:40]!r}")
        return int(text)

    return DeadLetter(
        payload=value or b"",
        error_class=h.get("prm-dl-error-class", ""),
        error_message=h.get("prm-dl-error-message", ""),
        source_topic=h.get("prm-dl-source-topic", ""),
        source_partition=number("prm-dl-source-partition", "-1"),
        source_offset=number("prm-dl-source-offset", "-1"),
        attempt=number("prm-dl-attempt", "1"),
        worker_id=h.get("prm-dl-worker-id", ""),
        original_headers={k[len("prm-dl-orig-") :]: v for k, v in h.items() if k.startswith("prm-dl-orig-")},
        original_size=number("prm-dl-original-size", "-1"),
    )


def headers_to_dict(headers: Headers | None) -> dict[str, str]:
    return {k: (v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)) for k, v in headers or ()}


__all__ = [
    "SCHEMA_VERSION",
    "COMPACT_SCHEMA_VERSION",
    "MAX_CHUNKS",
    "MAX_TURN_TOKENS",
    "SCHEMA_HEADER",
    "KIND_HEADER",
    "SchemaError",
    "UnknownSchemaVersion",
    "UnknownMessageKind",
    "InvalidMessage",
    "ExperimentMismatch",
    "check_channel",
    "ModelResponse",
    "Interaction",
    "ReadyTrajectory",
    "DiscardGroup",
    "TrajectoryChunk",
    "SessionTurn",
    "SessionEnd",
    "streamed_trajectory",
    "stream_session",
    "TRAJECTORY_KINDS",
    "STREAM_KINDS",
    "ALL_KINDS",
    "TrajectoryMessage",
    "compact_trajectory",
    "expand_trajectory",
    "check_expandable",
    "expand_trajectory_interactions",
    "schema_version_of",
    "PRMMetricObservation",
    "PRMTurnResult",
    "TokenRewards",
    "BranchResult",
    "TokenTurn",
    "TokenRef",
    "NotConcatExport",
    "compact_turns",
    "expand_turns",
    "SessionResult",
    "ScorerInfo",
    "GroupVerdict",
    "TurnSample",
    "decode_turn_sample",
    "DeadLetter",
    "encode",
    "decode_message",
    "decode_verdict",
    "dead_letter_headers",
    "dead_letter_from_record",
    "headers_to_dict",
    "pack_array",
    "to_tensor",
    "kind_of",
]
