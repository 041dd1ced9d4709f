"""What ``PRMRunner.run`` raises, and the worker's reason codes derived from it.

As in AReaL, a scorer's own exception propagates unchanged (its type is what callers
catch), and the runner's own checks raise ``ValueError`` / ``TypeError`` /
``RuntimeError`` with AReaL's message wording. Our context — which scorer, which
interaction, which branch and trajectory — is kept on the exception itself: a note
(``add_note``, shown in tracebacks) and a :class:`PRMErrorContext` under the
attribute :data:`CONTEXT_ATTR`. The worker turns any exception into a short, stable
reason code with :func:`failure_code` and a one-line description with
:func:`failure_detail`; neither depends on a wrapper type.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra import reasons

__all__ = [
    "CONTEXT_ATTR",
    "PRMErrorContext",
    "REJECTION_REASONS",
    "SCORER_REASON_PATTERN",
    "attach_context",
    "error_context",
    "failure_code",
    "failure_detail",
    "runner_error",
]

REJECTION_REASONS = frozenset(
    {
        reasons.SCORER_ERROR,  # a scorer (evaluate / evaluate_trajectory / prepare_result) raised
        reasons.SCORER_RETURNED_NONE,  # a scorer returned None for at least one turn
        reasons.INVALID_REWARD,  # wrong shape/type, non-finite, output_len <= 0, bad ids in a mapping
        reasons.INVALID_OBSERVATION,  # wrong target, duplicate, or a metric schema that changed
        reasons.NOT_TOKEN_BACKED,  # an interaction has no model_response
        reasons.INVALID_TRAJECTORY,  # the parent links do not form a forest
    }
)
"""The runner's own rejection codes (all registered in :mod:`infra.reasons`)."""
#: A scorer may name its own failure: an exception with a ``reason`` attribute that is a
#: registered code (:func:`infra.reasons.register`; e.g. the judges' ``judge_failed``)
#: is recorded under that code instead of ``scorer_error``, so a failed judge is told
#: apart from a buggy scorer. An unregistered one is recorded as ``scorer_error``.
SCORER_REASON_PATTERN = reasons.CODE_PATTERN

CONTEXT_ATTR = "prm_context"


@dataclass(frozen=True, slots=True)
class PRMErrorContext:
    """Where a run failed. ``reason`` is one of :data:`REJECTION_REASONS`."""

    reason: str
    scorer_name: str | None = None
    interaction_id: str | None = None
    leaf_id: str | None = None
    trajectory_id: str | None = None
    raised_by_scorer: bool = False

    def describe(self) -> str:
        parts = []
        if self.scorer_name is not None:
            parts.append(f"scorer {self.scorer_name!r}")
        if self.interaction_id is not None:
            parts.append(f"interaction {self.interaction_id!r}")
        if self.leaf_id is not None:
            parts.append(f"branch {self.leaf_id!r}")
        if self.trajectory_id is not None:
            parts.append(f"trajectory {self.trajectory_id!r}")
        return ", ".join(parts)


def error_context(exc: BaseException) -> PRMErrorContext | None:
    found = getattr(exc, CONTEXT_ATTR, None)
    return found if isinstance(found, PRMErrorContext) else None


def attach_context(exc: BaseException, context: PRMErrorContext) -> BaseException:
    """Record ``context`` on ``exc`` (first context wins) and add a note saying where."""
    if error_context(exc) is None:
        try:
            setattr(exc, CONTEXT_ATTR, context)
        except AttributeError:  # an exception type with __slots__: the note still tells
            pass
        verb = "raised in" if context.raised_by_scorer else "rejected by PRMRunner at"
        exc.add_note(f"PRM scoring: {verb} {context.describe()} (reason {context.reason})")
    return exc


def runner_error(
    cls: type[Exception],
    message: str,
    reason: str,
    *,
    scorer_name: str | None = None,
    interaction_id: str | None = None,
    leaf_id: str | None = None,
    trajectory_id: str | None = None,
) -> Exception:
    """One of the runner's own validation errors, with its context attached."""
    exc = cls(message)
    attach_context(exc, PRMErrorContext(reason, scorer_name, interaction_id, leaf_id, trajectory_id))
    return exc


def failure_code(exc: BaseException) -> str:
    """A short, stable reason code for a member's scoring failure.

    A registered code the exception declares itself (``exc.reason``, e.g.
    ``judge_failed``) wins;
    then the runner's context (``invalid_reward``, ``scorer_returned_none``, ...,
    ``scorer_error`` for anything a scorer raised); a bare ``TimeoutError`` is the
    worker's scoring deadline (``scorer_timeout``); anything else is ``scorer_error``.
    """
    declared = getattr(exc, "reason", None)
    if isinstance(declared, str) and reasons.is_member_code(declared):
        return declared
    context = error_context(exc)
    if context is not None:
        return context.reason
    if isinstance(exc, TimeoutError):
        return reasons.SCORER_TIMEOUT
    return reasons.SCORER_ERROR


def _unregistered_code(exc: BaseException) -> str | None:
    declared = getattr(exc, "reason", None)
    if isinstance(declared, str) and reasons.CODE_PATTERN.fullmatch(declared) and not reasons.is_member_code(declared):
        return declared
    return None


def failure_detail(exc: BaseException) -> str:
    """One line for a verdict: where (when known), the exception type and its text."""
    text = str(exc) or type(exc).__name__
    unregistered = _unregistered_code(exc)
    if unregistered is not None:  # say why the code it declared was not used
        text = f"{text} (its declared reason {unregistered!r} is not a registered member code: infra.reasons.register)"
    context = error_context(exc)
    if context is None or not context.raised_by_scorer:
        return text
    where = f"interaction {context.interaction_id!r}" if context.interaction_id else f"branch {context.leaf_id!r}"
    return f"scorer {context.scorer_name!r} raised {type(exc).__name__}, {where}: {text}"
