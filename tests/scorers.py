"""Scorers used by the integration tests (importable by worker subprocesses as ``tests.scorers.X``)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from scoring_workers.prm import BaseScorer
from scoring_workers.prm.capabilities import RecordSettings


class MarkerSettings(RecordSettings):
    marker: str | msgspec.UnsetType = msgspec.UNSET


class SlowSettings(RecordSettings):
    delay_s: float | msgspec.UnsetType = msgspec.UNSET
    hang_marker: str | msgspec.UnsetType = msgspec.UNSET


def _conversation_text(ctx: dict[str, Any]) -> str:
    return " ".join(str(m.get("content", "")) for m in ctx.get("messages", ()))


class FailOnMarkerScorer(BaseScorer):
    """Raises for conversations mentioning ``marker``; scores 0.0 otherwise."""

    name = "fail_on_marker"
    record_settings = MarkerSettings

    def __init__(self, weight: float = 1.0, enabled: bool = True, marker: str = "FAIL") -> None:
        super().__init__(weight=weight, enabled=enabled)
        self.marker = marker

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        if self.marker in _conversation_text(ctx):
            raise RuntimeError(f"scripted failure: conversation mentions {self.marker!r}")
        return 0.0


class SlowScorer(BaseScorer):
    """Sleeps ``delay_s`` per turn (or forever for conversations mentioning ``hang_marker``)."""

    name = "slow"
    record_settings = SlowSettings

    def __init__(
        self, weight: float = 1.0, enabled: bool = True, delay_s: float = 0.01, hang_marker: str = "HANG"
    ) -> None:
        super().__init__(weight=weight, enabled=enabled)
        self.delay_s = delay_s
        self.hang_marker = hang_marker

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        if self.hang_marker in _conversation_text(ctx):
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        return 0.0


def token_echo_rewards(input_tokens: Any, output_tokens: Any, n_messages: int) -> Any:
    """Per-output-token rewards that depend on the whole prompt, the conversation and each token."""
    import numpy as np

    base = (int(input_tokens[-1]) if len(input_tokens) else 0) + len(input_tokens) + n_messages
    return ((np.asarray(output_tokens, dtype=np.int64) + base) % 97).astype(np.float32) / np.float32(97)


class TokenEchoScorer(BaseScorer):
    """Rewards each output token from the turn's full prompt and conversation (:func:`token_echo_rewards`):
    a verdict shows whether the worker saw every turn exactly as the producer built it."""

    name = "token_echo"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> Any:
        mr = interaction.model_response
        return token_echo_rewards(mr.input_tokens, mr.output_tokens, len(interaction.messages))
