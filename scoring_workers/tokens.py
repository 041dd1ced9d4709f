"""Where a deciding worker gets its group members' token turns: Redis holds none.

The ledger parks what scoring produced plus each member's record coordinates
(partition, offset in the trajectories topic). Members of a group share its key, so they
land on one partition and are consumed by one worker at a time; that worker keeps the
compact token turns of the members it scored in memory (:meth:`MemberTokens.remember`).
A member consumed before a rebalance or a crash is read back from the log at its parked
coordinates. Either way the turns are ``compact_turns`` of the same record bytes, so any
worker builds the identical verdict. A chunked trajectory is parked at its first chunk's
coordinates; reading it back reads on from there until its last chunk.

The log must therefore keep a trajectory at least as long as its group can stay open
(``topics.retention_ms`` > ``worker.group_timeout_s`` + the re-publish grace, with room
for outages). A record that is gone anyway (deleted by retention, topic recreated)
cannot be trained on: its member is published ``failed`` with ``tokens_unavailable``.

A streamed session's member (``turn`` records and an ``end``) is held by no one record:
it is parked at its first ``turn`` record's coordinates (kept in the session's Redis hash
when that turn was parked, :mod:`scoring_workers.session_store`), and reading it back reads
on from there until its ``end``, rebuilding the ``ready`` form the worker scored
(:func:`infra.schema.streamed_trajectory`). So a rebalance or a crash between a session's
end and its group's decision costs a read, not the member, and Redis holds no token turns
of ended sessions. Only a session whose first turn was parked without its coordinates (by
an older worker) is parked at :data:`~scoring_workers.ledger.STREAMED_PARTITION`: its turns
come from the memory of the worker that scored its end, or the member is published
``failed`` with ``tokens_unavailable``.

The read-back itself lives in :mod:`infra.readback`: verdict readers use the same code
(and the same ``tokens_unavailable`` rule) for verdicts published with
``worker.verdict_tokens: reference``, which carry each member's record coordinates
instead of its turns — then the worker needs no turns at all to publish. With ``auto``
(the default) the worker builds the inline verdict and publishes it by reference only
when it would not fit ``kafka.max_message_bytes`` (:meth:`MemberTokens.references`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec

from infra.config import PipelineConfig
from infra.experiments import DEFAULT_EXPERIMENT
from infra.readback import TrajectoryReader, Wanted, reference, unavailable
from infra.schema import SessionResult, TokenRef, TokenTurn
from scoring_workers.ledger import STREAMED_PARTITION, ParkedMember


def _size(turns: Sequence[TokenTurn]) -> int:
    return sum(len(t.prompt_delta_raw) + len(t.output_tokens_raw) + len(t.output_logprobs_raw or b"") for t in turns)


class MemberTokens:
    """Token turns of group members: remembered when scored, read from the log otherwise.

    With ``worker.verdict_tokens: reference`` nothing is remembered or read: members
    are published with their record coordinates (:func:`infra.readback.reference`).
    With ``auto`` members are remembered and read as with ``inline``; :meth:`references`
    names their records for a verdict too large to carry them.
    """

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.inline = cfg.worker.verdict_tokens != "reference"  # inline or auto: the verdict is built with turns
        self.auto = cfg.worker.verdict_tokens == "auto"
        # token bytes kept in memory (worker.token_cache_bytes); beyond it the oldest are read back from the log
        self.max_bytes = cfg.worker.token_cache_bytes if self.inline else 0
        self._cache: OrderedDict[tuple[str, str], list[TokenTurn]] = OrderedDict()
        self._bytes = 0
        self._groups: dict[str, set[str]] = {}
        self._reader = TrajectoryReader(cfg)

    @property
    def log_reads(self) -> int:
        """Records fetched from the trajectories topic to read members back."""
        return self._reader.records_read

    # ------------------------------------------------------------------ memory
    def remember(self, group_id: str, trajectory_id: str, turns: list[TokenTurn]) -> None:
        key = (group_id, trajectory_id)
        if not self.inline or key in self._cache or not turns:
            return
        self._cache[key] = turns
        self._groups.setdefault(group_id, set()).add(trajectory_id)
        self._bytes += _size(turns)
        while self._bytes > self.max_bytes and self._cache:
            (g, t), old = self._cache.popitem(last=False)
            self._bytes -= _size(old)
            self._drop_index(g, t)

    def forget_group(self, group_id: str) -> None:
        for t in self._groups.pop(group_id, ()):
            turns = self._cache.pop((group_id, t), None)
            if turns is not None:
                self._bytes -= _size(turns)

    def _drop_index(self, group_id: str, trajectory_id: str) -> None:
        ids = self._groups.get(group_id)
        if ids is not None:
            ids.discard(trajectory_id)
            if not ids:
                del self._groups[group_id]

    # ------------------------------------------------------------------ members
    @staticmethod
    def _located(p: ParkedMember) -> bool:
        return p.result.status == "scored" and not p.result.turns and p.partition >= 0

    def references(self, parked: Sequence[ParkedMember]) -> dict[str, TokenRef] | None:
        """The records of the scored members, by trajectory id, when a verdict too large for
        ``kafka.max_message_bytes`` may name them instead of carrying their turns
        (``worker.verdict_tokens: auto``); None otherwise."""
        if not self.auto:
            return None
        return {
            p.result.trajectory_id: TokenRef(partition=p.partition, offset=p.offset) for p in parked if self._located(p)
        }

    async def members(
        self, group_id: str, parked: Sequence[ParkedMember], *, experiment_id: str = DEFAULT_EXPERIMENT
    ) -> list[SessionResult]:
        """The parked members as verdict sessions: scored ones with their token turns
        (inline) or their record coordinates (reference). ``group_id`` is the scoped key the
        members were remembered under; their records are in ``experiment_id``'s topic."""
        located = self._located
        if not self.inline:
            return [reference(p.result, p.partition, p.offset) if located(p) else p.result for p in parked]
        wanted = [
            Wanted(p.partition, p.offset, p.result.trajectory_id, group_id)
            for p in parked
            if located(p) and (group_id, p.result.trajectory_id) not in self._cache
        ]
        topic = self._reader.topic_of(experiment_id)
        read = await self._reader.read(wanted, topic=topic) if wanted else {}
        out = []
        for p in parked:
            r = p.result
            if located(p) or self._streamed(p):
                turns = self._cache.get((group_id, r.trajectory_id)) or read.get(
                    (p.partition, p.offset, r.trajectory_id)
                )
                if turns is None:
                    r = unavailable(r, topic, p.partition, p.offset)
                else:
                    r = msgspec.structs.replace(r, turns=turns)
            out.append(r)
        return out

    @staticmethod
    def _streamed(p: ParkedMember) -> bool:
        """A scored streamed member parked without its first turn's coordinates (at
        ``STREAMED_PARTITION``): its turns come from the memory of the worker that ended it,
        or not at all."""
        return p.result.status == "scored" and not p.result.turns and p.partition == STREAMED_PARTITION

    async def aclose(self) -> None:
        await self._reader.aclose()
