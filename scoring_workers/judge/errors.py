"""The judge's errors: those of one request (shared by the transport, the client and the
API adapters) and :class:`JudgeFailedError`, a turn whose every vote failed.

They live apart from the HTTP client so that scorers and adapters can catch them
without importing any HTTP library.
"""

from __future__ import annotations

from infra.errors import ScoringError

__all__ = ["CircuitOpenError", "JudgeFailedError", "JudgeRequestError", "JudgeTimeoutError"]


class JudgeRequestError(ScoringError):
    """A logical judge request failed.

    ``kind`` is one of ``connect``, ``timeout``, ``http_status``, ``transport``,
    ``circuit_open``, ``bad_response``; ``status`` is the HTTP status when there was
    one; ``attempts`` the number of HTTP attempts made.
    """

    def __init__(self, message: str, *, kind: str, status: int | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status
        self.attempts = attempts

    def __reduce__(self):
        return (_rebuild_error, (type(self), str(self), self.kind, self.status, self.attempts))


def _rebuild_error(cls, message, kind, status, attempts):
    return cls(message, kind=kind, status=status, attempts=attempts)


class JudgeTimeoutError(JudgeRequestError):
    """An attempt or the whole logical request ran out of time (deliberately *not* a
    :class:`TimeoutError`, which the worker reads as its own scoring timeout)."""


class CircuitOpenError(JudgeRequestError):
    """The judge's circuit breaker is open: failing fast without a request."""


class JudgeFailedError(ScoringError, RuntimeError):
    """Every judge vote of a turn failed (transport error or unparseable answer).

    Raised by the judge scorers when ``on_all_votes_failed="reject"`` (the default):
    a judge that could not decide must never look like a real ``0.0``. ``reason``
    is the stable rejection code the worker records (``getattr(exc, "reason")``).
    """

    reason = "judge_failed"

    def __init__(
        self,
        message: str,
        *,
        interaction_id: str | None = None,
        calls: int = 0,
        errors: int = 0,
        invalid: int = 0,
        last_error: str | None = None,
    ) -> None:
        super().__init__(message)
        self.interaction_id = interaction_id
        self.calls = calls
        self.errors = errors
        self.invalid = invalid
        self.last_error = last_error

    def __reduce__(self):  # keep the keyword-only fields when pickled
        return (
            _rebuild_judge_failed,
            (str(self), self.interaction_id, self.calls, self.errors, self.invalid, self.last_error),
        )


def _rebuild_judge_failed(message, interaction_id, calls, errors, invalid, last_error):
    return JudgeFailedError(
        message, interaction_id=interaction_id, calls=calls, errors=errors, invalid=invalid, last_error=last_error
    )
