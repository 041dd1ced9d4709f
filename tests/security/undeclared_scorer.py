"""A third-party scorer that declares no record-settable arguments (tests/security/test_registry_capabilities.py)."""

from __future__ import annotations

from typing import Any

from scoring_workers.prm import BaseScorer


class UndeclaredScorer(BaseScorer):
    """Takes an argument (a file it would read) but does not say records may set it."""

    name = "undeclared"

    def __init__(self, weight: float = 1.0, enabled: bool = True, model_path: str = "") -> None:
        super().__init__(weight=weight, enabled=enabled)
        self.model_path = model_path

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return 0.0
