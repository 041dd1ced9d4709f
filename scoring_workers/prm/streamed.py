"""Turn results computed before a session ends, kept exactly and reused at its end.

A worker scoring a streamed session runs each :attr:`~scoring_workers.prm.BaseScorer.streamable`
scorer on turn *t* as soon as *t*'s next state arrived (:meth:`PRMRunner.score_turn
<scoring_workers.prm.runner.PRMRunner.score_turn>`). The results wait in the ledger
as :class:`StreamedResult` until the session's ``end``; then the runner scores the
whole session as for a ``ready`` record, taking a turn's result from here instead of
calling the scorer again (:class:`Reuse`) when, and only when, the branch it is scored
on gives the same :meth:`~scoring_workers.prm.BaseScorer.stream_key` as the
conversation the streamed call saw. The verdict is therefore the one the ``ready`` form
gets: same inputs, same results, and what the runner does with a result (weighting,
validation, summing) runs at the end on the very values the scorer returned.

A result is stored as the runner would read it: a scalar as the float it is, a tensor
or array as float32 (the runner casts every dense reward to float32 before weighting,
so casting first changes no bit), observations as their wire structs.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from infra.schema import PRMMetricObservation
from scoring_workers.prm.base import PRMScorerResult

if TYPE_CHECKING:
    from scoring_workers.prm.base import BaseScorer
    from scoring_workers.prm.view import MessageCache

__all__ = ["StreamedResult", "Reuse", "stream_key_bytes", "encode_results", "decode_results"]

_ENCODER = msgspec.msgpack.Encoder()


class StreamedResult(msgspec.Struct, frozen=True, kw_only=True):
    """One streamable scorer's result for one turn, computed before the session ended."""

    scorer: int
    """The scorer's position among the runner's active scorers (config order)."""
    name: str
    interaction_id: str
    key: bytes
    """:func:`stream_key_bytes` of the conversation the call saw."""
    scalar: float | None = None
    dense: bytes | None = None
    """float32 little-endian, when the reward was a tensor or an array."""
    observations: tuple[PRMMetricObservation, ...] = ()

    @classmethod
    def of(cls, scorer: int, name: str, interaction_id: str, key: bytes, result: PRMScorerResult) -> StreamedResult:
        reward = result.reward
        if isinstance(reward, numbers.Real):  # as the runner reads it: float(reward)
            return cls(
                scorer=scorer,
                name=name,
                interaction_id=interaction_id,
                key=key,
                scalar=float(reward),
                observations=tuple(result.observations),
            )
        if hasattr(reward, "detach"):  # torch.Tensor, without importing torch
            reward = reward.detach().cpu().numpy()
        dense = np.ascontiguousarray(np.asarray(reward), dtype="<f4")
        return cls(
            scorer=scorer,
            name=name,
            interaction_id=interaction_id,
            key=key,
            dense=dense.tobytes(),
            observations=tuple(result.observations),
        )

    def result(self) -> PRMScorerResult:
        """The result as the runner reads it."""
        # A writable copy: torch refuses to wrap read-only arrays without a warning.
        reward: Any = self.scalar if self.dense is None else np.frombuffer(self.dense, dtype="<f4").copy()
        return PRMScorerResult(reward, self.observations)


_RESULTS = msgspec.msgpack.Decoder(list[StreamedResult])


def encode_results(results: Iterable[StreamedResult]) -> bytes:
    return _ENCODER.encode(list(results))


def decode_results(raw: bytes) -> list[StreamedResult]:
    return _RESULTS.decode(raw)


def stream_key_bytes(scorer: BaseScorer, interaction: Any, ctx: Mapping[str, Any]) -> bytes:
    """``scorer.stream_key`` as bytes that compare equal exactly when the keys do."""
    return _ENCODER.encode(scorer.stream_key(interaction, dict(ctx)))


class Reuse:
    """The streamed results of one session, looked up by the runner at its end.

    ``frozen``: the session's message cache the streamed calls filled
    (:meth:`PRMRunner.score_turn <scoring_workers.prm.runner.PRMRunner.score_turn>`'s
    ``cache``). The end's run starts from it instead of freezing every turn's
    conversation again: a turn id names one content within a session (a turn that
    arrives again with other content is refused), so its frozen messages are the same.
    """

    def __init__(self, results: Iterable[StreamedResult], frozen: MessageCache | None = None) -> None:
        self.frozen: MessageCache = {} if frozen is None else frozen
        self._by_turn: dict[tuple[int, str], list[StreamedResult]] = {}
        for r in results:
            self._by_turn.setdefault((r.scorer, r.interaction_id), []).append(r)
        self.hits = 0
        self.misses = 0

    def lookup(self, index: int, scorer: BaseScorer, view: Any, ctx: Mapping[str, Any]) -> PRMScorerResult | None:
        """The streamed result of active scorer ``index`` for ``view`` on the branch whose
        ctx is ``ctx``, or None (score it now) when none was computed on an equal key."""
        candidates = self._by_turn.get((index, view.interaction_id))
        if not candidates or candidates[0].name != scorer.name:
            self.misses += 1
            return None
        key = stream_key_bytes(scorer, view, ctx)
        for r in candidates:
            if r.key == key:
                self.hits += 1
                return r.result()
        self.misses += 1
        return None
