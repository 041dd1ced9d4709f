"""A module a registry record must never get imported on a worker (it is outside every allow-list).

Importing it leaves a trace in ``IMPORTED`` (read by tests/security/test_registry_rules.py).
"""

from __future__ import annotations

IMPORTED: list[str] = ["imported"]


class Payload:
    """Would run arbitrary code in the worker if it were ever built."""

    def __init__(self, **_: object) -> None:  # pragma: no cover - must never run
        raise AssertionError("a registry record ran code on a worker")
