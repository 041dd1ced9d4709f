"""What the worker, its fleet and the audit need of a scoring runner: :class:`ScoringRunner`.

:class:`~scoring_workers.prm.runner.PRMRunner` is the only production implementation;
the protocol names just the members the modules around it use, so that a module that
holds a runner (:mod:`scoring_workers.fleet`, :mod:`scoring_workers.scoring`,
:mod:`scoring_workers.scorer_report`, :mod:`scoring_workers.worker`) neither imports
the runner (and torch with it) nor takes ``Any``. It is runtime-checkable for tests;
``isinstance`` checks only that the members exist.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from infra.config import PRMConfig
    from infra.schema import Interaction, ReadyTrajectory, ScorerInfo
    from scoring_workers.prm.base import BaseScorer
    from scoring_workers.prm.results import ScoredTrajectory
    from scoring_workers.prm.streamed import Reuse, StreamedResult

__all__ = ["ScoringRunner"]


@runtime_checkable
class ScoringRunner(Protocol):
    """A runner one experiment's records are scored with (structurally a :class:`PRMRunner`)."""

    @property
    def config(self) -> PRMConfig:
        """The PRM config it was built from (the worker logs its scorers from it)."""
        ...

    @property
    def scorers(self) -> Sequence[BaseScorer]:
        """Every scorer, in config order, disabled ones included (start-up report)."""
        ...

    @property
    def active(self) -> bool:
        """Whether a run calls at least one scorer (start-up report)."""
        ...

    def scorer_infos(self) -> list[ScorerInfo]:
        """(name, version) of the scorers a run calls: what verdicts name (the fleet)."""
        ...

    async def run(
        self,
        trajectory: ReadyTrajectory,
        *,
        is_eval: bool | None = None,
        keep_channels: bool = False,
        reuse: Reuse | None = None,
    ) -> ScoredTrajectory:
        """Score every branch of ``trajectory`` (:func:`scoring_workers.scoring.score_member`)."""
        ...

    @property
    def streams(self) -> bool:
        """Whether a streamed turn has anything to run before its session ends."""
        ...

    async def score_turn(
        self, turn: Interaction, next_turn: Interaction, ctx: Mapping[str, Any], cache: dict[str, Any] | None = None
    ) -> list[StreamedResult]:
        """Run the streamable scorers on a streamed turn (:mod:`scoring_workers.streams`)."""
        ...

    async def aclose(self) -> None:
        """Close the scorers it owns (the worker's own runner; a fleet's replaced or retired ones)."""
        ...
