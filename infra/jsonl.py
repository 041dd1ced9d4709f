"""JSONL interchange: the human-writable form of ``prm.trajectories`` messages.

Kafka carries msgpack with token arrays packed as bytes (:mod:`infra.schema`); people,
fixtures and the synthetic workload generator want something they can read and write
by hand. This module is that bridge: one JSON object per line, token arrays as JSON
lists, converted to and from the very same wire structs, so a file that loads here is
exactly what a producer would have published (the wire structs' own validation runs).

Parsing is strict on purpose: unknown keys, wrong types and broken trees fail with a
:class:`JsonlError` that names the field path (``interactions[0].output_tokens: ...``)
and, from :func:`load`, the line (``data.jsonl:3: ...``). A typo in a hand-written file
should never be silently dropped. See ``docs/jsonl.md`` for the format.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from infra.errors import WireError
from infra.experiments import DEFAULT_EXPERIMENT
from infra.ids import WireId
from infra.schema import (
    DiscardGroup,
    GroupVerdict,
    Interaction,
    ModelResponse,
    ReadyTrajectory,
    SessionEnd,
    SessionTurn,
    TrajectoryMessage,
    expand_turns,
)
from infra.types import Int64, TokenId, validating

__all__ = ["JsonlError", "parse", "load", "load_lines", "dump", "write", "KINDS", "MAX_NESTING"]

KINDS = ("ready", "discard", "turn", "end")
MAX_NESTING = 128
"""A line nests arrays and objects at most this deep (its own object is level 1). Only the
free-form ``messages`` / ``output_message_list`` can go deep; the bound keeps every
accepted line decodable and re-encodable whatever the caller's stack (a JSON or msgpack
codec recurses once per level: 100,000 ``[`` would otherwise be a ``RecursionError``)."""
_MESSAGES_DEPTH = 3  # a message list's level minus one: the line, ``interactions``, the interaction
_TURN_MESSAGES_DEPTH = 2  # in a ``turn`` line: the line, its ``interaction``


class JsonlError(WireError, ValueError):
    """A JSONL record is not a valid message; the text names the field path (and line)."""


# --------------------------------------------------------------------------- JSON shape
# Private mirrors of the JSON layout. They exist so msgspec (in C) does the type and
# unknown-key checks, and so ``load`` can decode a line straight into typed structs
# without an intermediate dict. They are converted to the wire structs right away.
_Tokens = Annotated[list[TokenId], msgspec.Meta(description="a list of token ids (int32, non-negative)")]
_Numbers = Annotated[list[float], msgspec.Meta(description="a list of numbers")]
_MIN_INT, _MAX_INT = -(2**63), 2**64 - 1  # msgpack's integers; msgspec.json decodes any size


class _JInteraction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    interaction_id: WireId
    input_tokens: _Tokens
    output_tokens: _Tokens
    parent_id: WireId | None = None
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    output_message_list: list[dict[str, Any]] = msgspec.field(default_factory=list)
    output_logprobs: _Numbers | None = None
    stop_reason: str | None = None
    reward: float | None = None
    token_rewards: _Numbers | None = None


class _JReady(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="ready", tag_field="kind"):
    trajectory_id: WireId
    session_id: WireId
    group_id: WireId
    group_size: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    outcome_reward: float
    interactions: list[_JInteraction]
    is_eval: bool = False
    policy_version: Int64 | None = None
    created_at: float = 0.0
    experiment_id: str | None = None  # checked by the wire struct (its message names the grammar)


class _JDiscard(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="discard", tag_field="kind"):
    group_id: WireId
    reason: str = ""
    requested_at: float = 0.0
    experiment_id: str | None = None  # checked by the wire struct (its message names the grammar)


class _JTurn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="turn", tag_field="kind"):
    trajectory_id: WireId
    session_id: WireId
    group_id: WireId
    group_size: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    interaction: _JInteraction
    created_at: float = 0.0
    experiment_id: str | None = None


class _JEnd(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="end", tag_field="kind"):
    trajectory_id: WireId
    session_id: WireId
    group_id: WireId
    group_size: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    outcome_reward: float
    is_eval: bool = False
    policy_version: Int64 | None = None
    created_at: float = 0.0
    turn_count: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] | None = None
    experiment_id: str | None = None


_JLine = _JReady | _JDiscard | _JTurn | _JEnd
_BY_KIND: dict[str, type[_JReady] | type[_JDiscard] | type[_JTurn] | type[_JEnd]] = {
    "ready": _JReady,
    "discard": _JDiscard,
    "turn": _JTurn,
    "end": _JEnd,
}
_LINE_DECODER = msgspec.json.Decoder(_JLine)
_ENCODER = msgspec.json.Encoder()


# --------------------------------------------------------------------------- errors
def _too_deep(where: str = "") -> JsonlError:
    return JsonlError(f"{where + ': ' if where else ''}nested more than {MAX_NESTING} arrays/objects deep")


def _check_free_form(value: Any, depth: int, where: str = "", *, ints: bool = True) -> None:
    """Refuse ``value`` (at level ``depth + 1`` when it is a list or an object) when it nests
    past :data:`MAX_NESTING` or (``ints``) holds an integer msgpack cannot carry (JSON has
    no bound, the wire has 64 bits). A loop, not recursion: the point is to stay off the stack."""
    stack: list[tuple[Any, int]] = [(value, depth)] if isinstance(value, (dict, list)) else []
    while stack:
        item, level = stack.pop()
        if level >= MAX_NESTING:
            raise _too_deep(where)
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                stack.append((child, level + 1))
            elif ints and type(child) is int and not _MIN_INT <= child <= _MAX_INT:
                raise JsonlError(
                    f"{where + ': ' if where else ''}an integer outside msgpack's range (-2**63 .. 2**64-1)"
                )


# --------------------------------------------------------------------------- JSON -> wire
def _interaction(j: _JInteraction, where: str, depth: int = _MESSAGES_DEPTH) -> Interaction:
    _check_free_form(j.messages, depth, f"{where}.messages")
    _check_free_form(j.output_message_list, depth, f"{where}.output_message_list")
    n_out = len(j.output_tokens)
    logprobs = None
    if j.output_logprobs is not None:
        if len(j.output_logprobs) != n_out:
            raise JsonlError(
                f"{where}.output_logprobs: {len(j.output_logprobs)} values for {n_out} "
                "output tokens (need exactly one per output token)"
            )
        with np.errstate(over="ignore"):  # overflow becomes inf, refused just below
            logprobs = np.array(j.output_logprobs, dtype=np.float32)
        if not np.isfinite(logprobs).all():
            raise JsonlError(f"{where}.output_logprobs: values must be finite float32 numbers")
    token_rewards = None
    if j.token_rewards is not None:
        if len(j.token_rewards) != n_out:
            raise JsonlError(
                f"{where}.token_rewards: {len(j.token_rewards)} values for {n_out} "
                "output tokens (need exactly one per output token)"
            )
        with np.errstate(over="ignore"):
            token_rewards = np.array(j.token_rewards, dtype=np.float32)
        if not np.isfinite(token_rewards).all():
            raise JsonlError(f"{where}.token_rewards: values must be finite float32 numbers")
    try:
        response = ModelResponse.from_arrays(
            np.array(j.input_tokens, dtype=np.int32),  # bounds already checked by msgspec
            np.array(j.output_tokens, dtype=np.int32),
            logprobs,
            stop_reason=j.stop_reason,
        )
        return Interaction(
            interaction_id=j.interaction_id,
            parent_id=j.parent_id,
            messages=j.messages,
            output_message_list=j.output_message_list,
            reward=j.reward,
            model_response=response,
            token_rewards_raw=None if token_rewards is None else token_rewards.tobytes(),
        )
    except ValueError as exc:
        raise JsonlError(f"{where}: {exc}") from None


def _to_wire(j: _JReady | _JDiscard | _JTurn | _JEnd) -> TrajectoryMessage:
    if isinstance(j, _JDiscard):
        try:
            return DiscardGroup(
                group_id=j.group_id,
                reason=j.reason,
                requested_at=j.requested_at,
                experiment_id=_experiment(j.experiment_id),
            )
        except ValueError as exc:
            raise JsonlError(str(exc)) from None
    if isinstance(j, _JTurn):
        interaction = _interaction(j.interaction, "interaction", _TURN_MESSAGES_DEPTH)
        try:
            return SessionTurn(
                trajectory_id=j.trajectory_id,
                session_id=j.session_id,
                group_id=j.group_id,
                group_size=j.group_size,
                interaction=interaction,
                created_at=j.created_at,
                experiment_id=_experiment(j.experiment_id),
            )
        except ValueError as exc:
            raise JsonlError(str(exc)) from None
    if isinstance(j, _JEnd):
        try:
            return SessionEnd(
                trajectory_id=j.trajectory_id,
                session_id=j.session_id,
                group_id=j.group_id,
                group_size=j.group_size,
                outcome_reward=j.outcome_reward,
                is_eval=j.is_eval,
                policy_version=j.policy_version,
                created_at=j.created_at,
                turn_count=j.turn_count,
                experiment_id=_experiment(j.experiment_id),
            )
        except ValueError as exc:
            raise JsonlError(str(exc)) from None
    interactions = [_interaction(ji, f"interactions[{i}]") for i, ji in enumerate(j.interactions)]
    try:
        return ReadyTrajectory(
            trajectory_id=j.trajectory_id,
            session_id=j.session_id,
            group_id=j.group_id,
            group_size=j.group_size,
            interactions=interactions,
            outcome_reward=j.outcome_reward,
            is_eval=j.is_eval,
            policy_version=j.policy_version,
            created_at=j.created_at,
            experiment_id=_experiment(j.experiment_id),
        )
    except ValueError as exc:  # schema rules: finite reward, non-empty, tree shape, experiment id
        raise JsonlError(str(exc)) from None


def _experiment(experiment_id: str | None) -> str | msgspec.UnsetType:
    """A line's ``experiment_id`` as the wire struct holds it (absent: left out, the default)."""
    return msgspec.UNSET if experiment_id is None else experiment_id


def parse(obj: Any) -> TrajectoryMessage:
    """Validate one decoded JSON object and return the wire message it describes.

    Raises :class:`JsonlError` naming the offending field path.
    """
    if not isinstance(obj, dict):
        raise JsonlError(f"expected a JSON object, got {type(obj).__name__}")
    if "kind" not in obj:
        raise JsonlError(f"kind: missing required field (expected one of {list(KINDS)})")
    kind = obj["kind"]
    if kind not in KINDS:  # also catches non-string kinds
        raise JsonlError(f"kind: unknown kind {kind!r} (expected one of {list(KINDS)})")
    try:
        with validating(root=_BY_KIND[kind], error=JsonlError):
            j = msgspec.convert(obj, _BY_KIND[kind])
    except RecursionError:  # msgspec recurses per level: far deeper than MAX_NESTING
        raise _too_deep() from None
    return _to_wire(j)


def _parse_line(line: bytes) -> TrajectoryMessage:
    try:
        j = _LINE_DECODER.decode(line)  # fast path: JSON straight into typed structs
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError: explained below
        pass
    else:
        return _to_wire(j)
    # Slow path, errors only: decode untyped so the message matches ``parse`` exactly.
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise JsonlError(f"invalid JSON: {exc}") from None
    except RecursionError:  # msgspec recurses per level: far deeper than MAX_NESTING
        raise _too_deep() from None
    _check_free_form(obj, 0, ints=False)  # as deep as the stack allowed: refused whatever the caller's stack
    return parse(obj)


def load(path: str | os.PathLike[str]) -> Iterator[TrajectoryMessage]:
    """Yield the messages of a JSONL file in order, skipping blank lines (see :func:`load_lines`)."""
    return (message for _, message in load_lines(path))


def load_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, TrajectoryMessage]]:
    """Yield ``(line number, message)`` of a JSONL file in order, skipping blank lines.

    Errors are :class:`JsonlError` prefixed with ``file:line:``. The file is read line
    by line, so large workloads stream. A UTF-8 byte-order mark (what some Windows
    editors write) is skipped, not an "invalid character" at byte 0.
    """
    name = os.fspath(path)
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if lineno == 1:
                line = line.removeprefix(codecs.BOM_UTF8)
            if not line.strip():
                continue
            try:
                yield lineno, _parse_line(line)
            except JsonlError as exc:
                raise JsonlError(f"{name}:{lineno}: {exc}") from None


# --------------------------------------------------------------------------- wire -> JSON
def dump(message: TrajectoryMessage) -> dict[str, Any]:
    """The JSON object for ``message`` (inverse of :func:`parse`; tokens as lists).

    Optional fields are written only when set, so dumped files stay close to what a
    person would write. Interactions without a ``model_response`` cannot be dumped:
    the format (like the scorers) requires token-backed turns.
    """
    if isinstance(message, DiscardGroup):
        out: dict[str, Any] = {"kind": "discard", "group_id": message.group_id, "reason": message.reason}
        if message.requested_at:
            out["requested_at"] = message.requested_at
        if message.experiment_id is not msgspec.UNSET:
            out["experiment_id"] = message.experiment_id
        return out
    if isinstance(message, SessionTurn):
        if message.is_compact:
            raise JsonlError(
                f"turn {message.interaction.interaction_id!r} is compact; JSONL carries full turns "
                "(expand the session first)"
            )
        out = {"kind": "turn", **_member(message), "interaction": _dump_interaction(message.interaction)}
        if message.created_at:
            out["created_at"] = message.created_at
        return out
    if isinstance(message, SessionEnd):
        out = {"kind": "end", **_member(message), "outcome_reward": message.outcome_reward, "is_eval": message.is_eval}
        for name in ("policy_version", "turn_count"):
            if getattr(message, name) is not None:
                out[name] = getattr(message, name)
        if message.created_at:
            out["created_at"] = message.created_at
        return out
    if not isinstance(message, ReadyTrajectory):
        raise TypeError(f"cannot dump {type(message).__name__} as a JSONL trajectory record")
    out = {
        "kind": "ready",
        "trajectory_id": message.trajectory_id,
        "session_id": message.session_id,
        "group_id": message.group_id,
        "group_size": message.group_size,
        "outcome_reward": message.outcome_reward,
        "is_eval": message.is_eval,
    }
    if message.policy_version is not None:
        out["policy_version"] = message.policy_version
    if message.created_at:
        out["created_at"] = message.created_at
    if message.experiment_id is not msgspec.UNSET:
        out["experiment_id"] = message.experiment_id
    out["interactions"] = [_dump_interaction(i) for i in message.interactions]
    return out


def _member(message: SessionTurn | SessionEnd) -> dict[str, Any]:
    out: dict[str, Any] = {
        "trajectory_id": message.trajectory_id,
        "session_id": message.session_id,
        "group_id": message.group_id,
        "group_size": message.group_size,
    }
    if message.experiment_id is not msgspec.UNSET:
        out["experiment_id"] = message.experiment_id
    return out


def _dump_interaction(it: Interaction) -> dict[str, Any]:
    mr = it.model_response
    if mr is None:
        raise JsonlError(f"interaction {it.interaction_id!r} has no model_response; JSONL needs tokens")
    out: dict[str, Any] = {
        "interaction_id": it.interaction_id,
        "parent_id": it.parent_id,
        "messages": it.messages,
        "output_message_list": it.output_message_list,
        "input_tokens": mr.input_tokens.tolist(),  # numpy's C loop, not a Python one
        "output_tokens": mr.output_tokens.tolist(),
    }
    logprobs = mr.output_logprobs
    if logprobs is not None:
        out["output_logprobs"] = logprobs.tolist()
    if mr.stop_reason is not None:
        out["stop_reason"] = mr.stop_reason
    if it.reward is not None:
        out["reward"] = it.reward
    if it.token_rewards is not None:
        out["token_rewards"] = it.token_rewards.tolist()
    return out


def dump_verdict(verdict: GroupVerdict, *, include_tokens: bool = False) -> dict[str, Any]:
    """The JSON line ``prm-pipeline verdicts`` prints for one verdict (docs/jsonl.md).

    Token rewards are expanded to one float per output token; the token-backed
    interactions (for the trainer) are left out unless ``include_tokens``.
    """
    sessions = []
    for s in verdict.sessions:
        entry: dict[str, Any] = {
            "session_id": s.session_id,
            "trajectory_id": s.trajectory_id,
            "status": s.status,
            "outcome_reward": s.outcome_reward,
            "is_eval": s.is_eval,
            "policy_version": s.policy_version,
            "branches": [
                {
                    "leaf_id": b.leaf_id,
                    "path": b.path,
                    "token_rewards": {iid: tr.to_numpy().tolist() for iid, tr in b.token_rewards.items()},
                    "scorer_totals": b.scorer_totals,
                }
                for b in s.branches
            ],
            "stats": s.stats,
        }
        if s.error:
            entry["error"] = s.error
        for name in ("error_code", "error_scorer", "error_detail"):
            if getattr(s, name) is not None:
                entry[name] = getattr(s, name)
        if s.turn_results:
            entry["turn_results"] = msgspec.to_builtins(s.turn_results)
        if include_tokens:
            entry["interactions"] = [_dump_interaction(i) for i in expand_turns(s.turns)]
        sessions.append(entry)
    out: dict[str, Any] = {
        "group_id": verdict.group_id,
        "status": verdict.status,
        "reason_code": verdict.reason_code,
        "reason": verdict.reason,
        "verdict_version": verdict.verdict_version,
        "group_size": verdict.group_size,
        "sessions": sessions,
        "scorers": [{"name": sc.name, "version": sc.version} for sc in verdict.scorers],
        "worker_id": verdict.worker_id,
        "decided_at": verdict.decided_at,
        "timings": verdict.timings,
    }
    if verdict.experiment_id != DEFAULT_EXPERIMENT:  # left out for the default one, as on the wire
        out["experiment_id"] = verdict.experiment_id
    return out


def write(path: str | os.PathLike[str], messages: Iterable[TrajectoryMessage]) -> int:
    """Write ``messages`` to ``path`` as JSONL (one object per line); return the count."""
    count = 0
    buf = bytearray()
    with open(Path(path), "wb") as fh:
        for message in messages:
            buf.clear()
            _ENCODER.encode_into(dump(message), buf)
            buf += b"\n"
            fh.write(buf)
            count += 1
    return count
