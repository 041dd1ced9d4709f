"""Scorers for the ecosystem tests (importable by worker processes as ``tests.ecosystem.scorers.X``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from scoring_workers.prm import BaseScorer


class TokenParityScorer(BaseScorer):
    """A per-token reward anyone can compute by hand: ``even`` for even token ids, ``odd`` for odd ones."""

    name = "token_parity"

    def __init__(self, weight: float = 1.0, enabled: bool = True, even: float = 0.5, odd: float = -0.25) -> None:
        super().__init__(weight=weight, enabled=enabled)
        self.even, self.odd = float(even), float(odd)

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> np.ndarray:
        tokens = interaction.model_response.output_tokens
        return np.where(tokens % 2 == 0, self.even, self.odd).astype(np.float32)
