"""Reason codes: the one registry of why a group was rejected or discarded, or a member failed.

A verdict says why in two fields: ``reason_code`` (a short, stable code from this
registry, for programs and metric labels) and ``reason`` (free text for people). A
failed member does the same with ``error_code`` and ``error_detail``. Every code a
worker writes is registered here, so

* no reader parses ``"code: detail"`` text to find the code;
* metrics label by code only (:func:`metric_label`): free text such as a discard's
  ``"environment crashed before ..."`` can never become an unbounded label set;
* docs/wire.md's table of codes is rendered from this registry
  (:func:`render_markdown`, checked by a test), so the docs cannot drift.

A scorer may declare its own failure code (an exception attribute ``reason``, as the
judges' ``judge_failed``); it must :func:`register` it first (at import of the scorer's
module), or the failure is recorded as ``scorer_error``.

Run ``python -m infra.reasons docs/wire.md`` to rewrite the table in the docs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Final, Literal

from infra.config import ConfigError

__all__ = [
    "CODE_PATTERN",
    "OTHER",
    "UNSPECIFIED",
    "Reason",
    "ReasonStatus",
    "get",
    "is_member_code",
    "is_registered",
    "metric_label",
    "register",
    "registered",
    "render_markdown",
    "require",
    "DISCARDED",
    "UNKNOWN_EXPERIMENT",
    "INVALID_MEMBER",
    "GROUP_SIZE_MISMATCH",
    "MISSING_SESSIONS",
    "VERDICT_TOO_LARGE",
    "NOT_CONCAT_EXPORT",
    "TOKENS_UNAVAILABLE",
    "SCORER_ERROR",
    "SCORER_TIMEOUT",
    "SCORER_RETURNED_NONE",
    "INVALID_REWARD",
    "INVALID_OBSERVATION",
    "NOT_TOKEN_BACKED",
    "INVALID_TRAJECTORY",
    "SESSION_IDLE",
    "JUDGE_FAILED",
]

CODE_PATTERN: Final = re.compile(r"[a-z][a-z0-9_]{0,39}")
"""What a code looks like: bounded, identifier-like, safe in a metric label or key."""

UNSPECIFIED: Final = "unspecified"
"""Metric label of a rejected or discarded verdict that carries no ``reason_code``
(written before the field existed). Never written on the wire."""

OTHER: Final = "other"
"""Metric label of a code this process has not registered (e.g. a plugin scorer's code
seen by a trainer that does not import the scorer). Never written on the wire."""

ReasonStatus = Literal["rejected", "discarded"]


@dataclass(frozen=True, slots=True)
class Reason:
    """One registered code.

    ``status`` is the verdict status it comes with; ``member`` is true when it is also a
    failed member's ``error_code`` (the group is then rejected with the first failed
    member's code, by trajectory id); ``builtin`` is false for codes scorers registered.
    """

    code: str
    status: ReasonStatus
    member: bool
    meaning: str
    builtin: bool = True


_REGISTRY: dict[str, Reason] = {}


def _add(code: str, status: ReasonStatus, member: bool, meaning: str, *, builtin: bool = True) -> str:
    if not isinstance(code, str) or not CODE_PATTERN.fullmatch(code):
        raise ConfigError(f"reason code {code!r} must match {CODE_PATTERN.pattern} (lower case, digits, '_')")
    reason = Reason(code, status, member, meaning, builtin)
    known = _REGISTRY.get(code)
    if known is not None and (known.status, known.member) != (status, member):
        raise ConfigError(f"reason code {code!r} is already registered as {known}")
    if known is None:
        _REGISTRY[code] = reason
    return code


# --------------------------------------------------------------------------- group decisions
DISCARDED: Final = _add(
    "discarded",
    "discarded",
    False,
    "a producer's `discard` for the group arrived; `reason` is the discard's own text (`discarded` when it "
    "had none); `sessions` list the members consumed before it, status `discarded`, without results",
)
UNKNOWN_EXPERIMENT: Final = _add(
    "unknown_experiment",
    "rejected",
    True,
    "the record came from the topic of an experiment the worker no longer serves (removed while its records "
    "were being read); `reason` names it; the record itself is dead-lettered (`UnknownExperiment`)",
)
INVALID_MEMBER: Final = _add(
    "invalid_member",
    "rejected",
    False,
    "a record keyed by the group was dead-lettered (undecodable or persistently failing); `reason` names "
    "its coordinates `topic:partition@offset` and the error",
)
GROUP_SIZE_MISMATCH: Final = _add(
    "group_size_mismatch", "rejected", False, "members announced different `group_size` values"
)
MISSING_SESSIONS: Final = _add(
    "missing_sessions", "rejected", False, "fewer members than `group_size` arrived before `worker.group_timeout_s`"
)
VERDICT_TOO_LARGE: Final = _add(
    "verdict_too_large",
    "rejected",
    False,
    "the verdict record would exceed `kafka.max_message_bytes` with members' token turns inline "
    "(`worker.verdict_tokens: inline`) or even with their records named instead (`auto`, `reference`); "
    "published with members' token turns (and, if needed, branches and turn results) dropped, stats kept; "
    "`reason` gives the sizes and the original status",
)

# --------------------------------------------------------------------------- member failures
NOT_CONCAT_EXPORT: Final = _add(
    "not_concat_export",
    "rejected",
    True,
    "a turn has no `model_response`, or its input does not start with its parent's input + output",
)
TOKENS_UNAVAILABLE: Final = _add(
    "tokens_unavailable",
    "rejected",
    True,
    "the member's record could not be read back from the trajectories topic (retention, recreated topic)",
)
SCORER_ERROR: Final = _add("scorer_error", "rejected", True, "a scorer raised (`error_scorer` names it)")
SCORER_TIMEOUT: Final = _add(
    "scorer_timeout", "rejected", True, "scoring the member took longer than `worker.scorer_timeout_s`"
)
SCORER_RETURNED_NONE: Final = _add(
    "scorer_returned_none", "rejected", True, "a scorer returned no result for at least one turn"
)
INVALID_REWARD: Final = _add(
    "invalid_reward",
    "rejected",
    True,
    "a reward of the wrong shape or type, non-finite, for a turn with no output tokens, or pre-existing "
    "`token_rewards` whose length differs from the turn's output",
)
INVALID_OBSERVATION: Final = _add(
    "invalid_observation",
    "rejected",
    True,
    "a metric observation with a wrong target, a duplicate, or a schema that changed",
)
NOT_TOKEN_BACKED: Final = _add(
    "not_token_backed", "rejected", True, "the scoring run met an interaction without a `model_response`"
)
INVALID_TRAJECTORY: Final = _add(
    "invalid_trajectory", "rejected", True, "the scoring run found parent links that do not form a forest"
)
SESSION_IDLE: Final = _add(
    "session_idle",
    "rejected",
    True,
    "a streamed session received no record for `worker.session_idle_s` before its `end`: it is answered "
    "as a missing member instead of keeping its group open",
)
JUDGE_FAILED: Final = _add(
    "judge_failed",
    "rejected",
    True,
    "every judge vote of a turn failed (request errors or no valid score; the detail carries the last "
    "underlying error), or a teacher request failed",
)


# --------------------------------------------------------------------------- API
def register(code: str, meaning: str) -> str:
    """Register a scorer's own failure code (a member failure that rejects its group).

    Idempotent; returns ``code``. Call it when the scorer's module is imported, so the
    worker (and any process that imports the scorer) knows the code.
    """
    return _add(code, "rejected", True, meaning, builtin=False)


def is_registered(code: str) -> bool:
    return code in _REGISTRY


def is_member_code(code: str) -> bool:
    """True for a registered code a failed member may carry (``error_code``)."""
    reason = _REGISTRY.get(code)
    return reason is not None and reason.member


def get(code: str) -> Reason:
    """The registered :class:`Reason` of ``code`` (``KeyError`` naming the known codes)."""
    try:
        return _REGISTRY[code]
    except KeyError:
        raise KeyError(f"unknown reason code {code!r}; registered: {sorted(_REGISTRY)}") from None


def require(code: str, *, member: bool = False) -> str:
    """``code`` if registered (as a member code when ``member``), else a ``ValueError``:
    writers only write registered codes."""
    if not (is_member_code(code) if member else is_registered(code)):
        known = sorted(r.code for r in _REGISTRY.values() if r.member or not member)
        raise ConfigError(
            f"reason code {code!r} is not registered{' as a member code' if member else ''} "
            f"(infra.reasons.register); registered: {known}"
        )
    return code


def registered(*, builtin_only: bool = False) -> list[Reason]:
    """Every registered reason, in registration order."""
    return [r for r in _REGISTRY.values() if r.builtin or not builtin_only]


def metric_label(status: str, code: str) -> str:
    """The metric label (or key part) for a verdict's or member's code: bounded by construction.

    ``""`` for an accepted verdict; the code when registered; :data:`UNSPECIFIED` when a
    non-accepted record carries none; :data:`OTHER` for anything else.
    """
    if status == "accepted":
        return ""
    if not code:
        return UNSPECIFIED
    return code if code in _REGISTRY else OTHER


# --------------------------------------------------------------------------- docs
DOC_BEGIN: Final = "<!-- reason-codes:begin (generated by `python -m infra.reasons docs/wire.md`; do not edit) -->"
DOC_END: Final = "<!-- reason-codes:end -->"


def render_markdown() -> str:
    """The table of built-in codes as docs/wire.md shows it (between its markers)."""
    rows = ["| `reason_code` | verdict status | also a member's `error_code` | meaning |", "|---|---|---|---|"]
    for r in registered(builtin_only=True):
        rows.append(f"| `{r.code}` | `{r.status}` | {'yes' if r.member else 'no'} | {r.meaning} |")
    return "\n".join(rows) + "\n"


def rewrite_doc(text: str) -> str:
    """``text`` with the block between :data:`DOC_BEGIN` and :data:`DOC_END` re-rendered."""
    start, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if start < 0 or end < start:
        raise ValueError(f"markers not found: {DOC_BEGIN!r} ... {DOC_END!r}")
    return text[: start + len(DOC_BEGIN)] + "\n" + render_markdown() + text[end:]


def doc_block(text: str) -> str:
    """The block between the markers in ``text`` (what :func:`rewrite_doc` would replace)."""
    start, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if start < 0 or end < start:
        raise ValueError(f"markers not found: {DOC_BEGIN!r} ... {DOC_END!r}")
    return text[start + len(DOC_BEGIN) + 1 : end]


if __name__ == "__main__":  # python -m infra.reasons docs/wire.md
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as fh:
            old = fh.read()
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(rewrite_doc(old))
