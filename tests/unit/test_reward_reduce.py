"""``reduce_process``: the one scalar trainers that take a number per sample get from process rewards."""

from __future__ import annotations

import numpy as np
import pytest

from shaper.reward_client import SampleReward, reduce_process


def reward(status: str = "accepted") -> SampleReward:
    # response: turn [0, 2), a tool token at 2 (never the model's), turn [3, 5)
    tokens = np.array([0.5, -0.25, 9.0, 1.0, 0.25], dtype=np.float32)
    return SampleReward("g", "g/t", status, "", 1.0, tokens, [0.125, 0.625], [(0, 2), (3, 5)])


@pytest.mark.parametrize(("how", "expected"), [("mean", 0.375), ("sum", 1.5), ("last", 0.25)])
def test_reductions_cover_only_generated_tokens(how: str, expected: float) -> None:
    assert reduce_process(reward(), how) == pytest.approx(expected)


@pytest.mark.parametrize("status", ["rejected", "discarded", "timeout"])
def test_no_process_scalar_without_an_accepted_verdict(status: str) -> None:
    assert reduce_process(reward(status), "sum") == 0.0


def test_unknown_reduction_is_refused() -> None:
    with pytest.raises(ValueError, match="'mean', 'sum' or 'last'"):
        reduce_process(reward(), "max")  # type: ignore[arg-type]
