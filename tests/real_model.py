"""The tiny real LM for the invariant tests: sessions sampled by the rollout proxy, scored
in-process the way a worker scores them, laid out as the trainer's batch."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from infra.config import PRMConfig
from infra.schema import GroupVerdict, ReadyTrajectory, ScorerInfo
from prm_pipeline.audit.rescoring import rescore
from scoring_workers.prm import BaseScorer, PRMRunner
from shaper.batch import TrainingBatch, build_training_batch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Sample and score with one torch thread (two shared cores), restoring the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=1)
def policy() -> Any:
    from prm_pipeline.demo.tiny_model import TinyPolicy

    return TinyPolicy.create()


def proxy(seed: int = 0) -> Any:
    from prm_pipeline.demo.rollout_proxy import RolloutConfig, RolloutProxy

    return RolloutProxy(policy(), RolloutConfig(group_size=2, seed=seed))


class TokenIdScorer(BaseScorer):
    """Rewards every output token with ``its token id + 0.5``: a reward that names its token."""

    name = "token_id"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> torch.Tensor:
        return torch.from_numpy(interaction.model_response.output_tokens.astype("float32") + 0.5)


async def verdict(
    group_id: str, sessions: Sequence[ReadyTrajectory], scorers: Sequence[BaseScorer] | None = None
) -> GroupVerdict:
    """The accepted verdict a worker would publish for ``sessions``."""
    scorers = list(scorers or [TokenIdScorer()])
    runner = await PRMRunner.create(PRMConfig(scorers=scorers))  # type: ignore[arg-type]
    try:
        members = [await rescore(runner, s, timeout_s=30) for s in sessions]
    finally:
        await runner.aclose()
    assert all(m.status == "scored" for m in members), [m.error for m in members]
    return GroupVerdict(
        group_id=group_id,
        status="accepted",
        group_size=len(members),
        sessions=members,
        scorers=[ScorerInfo(s.name, s.version) for s in scorers],
        worker_id="test",
    )


async def batch(
    group_id: str, sessions: Sequence[ReadyTrajectory], scorers: Sequence[BaseScorer] | None = None
) -> TrainingBatch:
    return build_training_batch([await verdict(group_id, sessions, scorers)])
