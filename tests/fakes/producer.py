"""An in-memory Kafka producer for the worker's unit tests: it keeps what was sent, and can refuse."""

from __future__ import annotations

from typing import Any

from infra.config import PipelineConfig
from infra.schema import GroupVerdict, decode_verdict


class FakeProducer:
    """Keeps what the worker produced; raises what ``fail`` holds first."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes | None, Any]] = []
        self.fail: list[BaseException] = []

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None, headers: Any = None) -> None:
        if self.fail:
            raise self.fail.pop(0)
        self.sent.append((topic, value, key, headers))

    def verdicts(self) -> list[GroupVerdict]:
        topic = PipelineConfig().topics.verdicts
        return [decode_verdict(value, headers) for t, value, _, headers in self.sent if t == topic]

    def dead_letters(self) -> list[bytes | None]:
        return [key for t, _, key, _ in self.sent if t == PipelineConfig().topics.dead_letters]
