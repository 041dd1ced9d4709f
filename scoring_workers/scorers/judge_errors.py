"""The errors of a judge (or teacher) request, shared by the transport and the API adapters.

They live apart from the HTTP client so that scorers and adapters can catch them
without importing any HTTP library.
"""

from __future__ import annotations

from infra.errors import ScoringError

__all__ = ["CircuitOpenError", "JudgeRequestError", "JudgeTimeoutError"]


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
