"""Adaptive voting is exactly OpenClaw-RL's majority of m votes, with fewer calls."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from scoring_workers.judge.voting import (
    Vote,
    decided_outcome,
    majority_vote,
    run_votes,
    votes_to_request,
)

VALUES = (1, 0, -1, None)


async def _run(seq, m, **kwargs):
    calls: list[int] = []

    async def request(i: int):
        calls.append(i)
        await asyncio.sleep(0)
        return seq[i]

    result = await run_votes(request, m, **kwargs)
    return result, calls


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
async def test_adaptive_equals_full_voting_on_every_sequence(m):
    total_calls = 0
    sequences = list(itertools.product(VALUES, repeat=m))
    for seq in sequences:
        full, full_calls = await _run(seq, m, adaptive=False)
        adaptive, calls = await _run(seq, m, adaptive=True)
        expected = majority_vote(seq)
        assert full.score == expected, seq
        assert adaptive.score == expected, (seq, adaptive)
        assert sorted(full_calls) == list(range(m))
        # the adaptive run used a prefix of the sequence, each vote once
        assert sorted(calls) == list(range(adaptive.calls)) and adaptive.calls <= m
        assert [v.score for v in adaptive.votes] == list(seq[: adaptive.calls])
        assert adaptive.saved == m - adaptive.calls and not adaptive.escalated
        total_calls += adaptive.calls
    assert len(sequences) == 4**m
    if m >= 3:
        assert total_calls < m * len(sequences)  # strictly cheaper on average


async def test_m3_asks_two_and_skips_the_third_when_they_agree():
    for agree in (1, 0, -1):
        result, calls = await _run((agree, agree, 1), 3)
        assert result.score == float(agree) and calls == [0, 1] and result.saved == 1
    for seq in [(1, -1, 1), (1, None, 1), (None, None, -1), (1, 0, -1), (0, 1, 1)]:
        result, calls = await _run(seq, 3)
        assert result.calls == 3 and result.score == majority_vote(seq)


async def test_m5_first_batch_is_three():
    result, calls = await _run((1, 1, 1, -1, -1), 5)
    assert calls == [0, 1, 2] and result.score == 1.0
    result, calls = await _run((1, 1, -1, -1, 1), 5)
    assert result.calls == 5 and result.score == 1.0


def test_decided_outcome_cases():
    assert decided_outcome((2, 0, 0), 1) == 1.0
    assert decided_outcome((0, 0, 2), 1) == -1.0
    assert decided_outcome((0, 2, 0), 1) == 0.0  # 0 wins or ties -> 0.0 either way
    assert decided_outcome((1, 0, 0), 1) is None  # a -1 would tie -> 0.0
    assert decided_outcome((1, 0, 1), 1) is None
    assert decided_outcome((0, 0, 0), 0) == 0.0  # nothing valid
    assert decided_outcome((1, 1, 1), 0) == 0.0
    assert decided_outcome((1, 1, 0), 2) is None
    assert decided_outcome((2, 2, 0), 1) is None  # a third 1 wins, anything else ties
    assert decided_outcome((0, 3, 1), 1) == 0.0  # 0 leads, -1 can only tie


def test_votes_to_request():
    assert votes_to_request((0, 0, 0), 3) == 2
    assert votes_to_request((0, 0, 0), 5) == 3
    assert votes_to_request((0, 0, 0), 4) == 2  # two 0 votes already settle 0.0
    assert votes_to_request((1, 0, 0), 1) == 1
    assert votes_to_request((2, 0, 0), 1) == 0
    assert votes_to_request((1, 1, 0), 3) == 2


async def test_escalation_resolves_split_votes():
    seq = (1, 0, -1, 1, 1, 1)
    result, _ = await _run(seq, 3, max_votes=6)
    assert result.escalated and result.calls == 4 and result.score == 1.0  # tie broken by the 4th vote
    result, _ = await _run((1, -1, None, 0, -1), 3, max_votes=5)
    assert result.escalated and result.calls == 5 and result.score == -1.0
    result, _ = await _run((1, -1, 0, 0, 1, -1), 3, max_votes=4)
    assert result.escalated and result.calls == 4 and result.score == 0.0  # budget exhausted: still 0 wins
    result, _ = await _run((None, None, None, 1), 3, max_votes=4)
    assert not result.escalated and result.calls == 3 and result.all_failed  # no valid vote: nothing to split
    result, _ = await _run((1, 1, -1), 3, max_votes=5)
    assert not result.escalated and result.calls == 2


async def test_vote_result_accounting():
    seq = (Vote(1, "yes \\boxed{1}"), Vote(None, None, "connect: refused"), Vote(None, "??"), Vote(1, "\\boxed{1}"))

    async def request(i):
        return seq[i]

    result = await run_votes(request, 4)
    assert result.score == 1.0 and result.errors == 1 and result.invalid == 1 and not result.all_failed
    assert result.deciding() == (0, 3)


async def test_run_votes_validates_arguments_and_propagates_errors():
    async def request(i):
        return 1

    with pytest.raises(ValueError):
        await run_votes(request, 0)
    with pytest.raises(ValueError):
        await run_votes(request, 3, max_votes=2)

    async def boom(i):
        raise RuntimeError("bug in request")

    with pytest.raises(RuntimeError, match="bug in request"):
        await run_votes(boom, 3)
