"""The shaper's own exceptions (the trainer side): both sit in :class:`~infra.errors.TrainingError`
and keep the standard base they replaced, so ``except ValueError`` / ``except RuntimeError``
written before them still catch them."""

from __future__ import annotations

from infra.errors import TrainingError

__all__ = ["ShapingInputError", "VerdictMismatch"]


class ShapingInputError(TrainingError, ValueError):
    """A tensor, sample, group or verdict handed to the shaper or a trainer adapter is
    malformed: a shape, dtype, length or count that does not fit, or a non-finite value."""


class VerdictMismatch(TrainingError, RuntimeError):
    """A verdict does not fit the batch the trainer holds (a member, turn, token or row
    count differs), or no row of a batch names a verdict at all."""
