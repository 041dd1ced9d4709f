"""OpenClaw-RL's vote combination and adaptive voting, as plain functions (no HTTP, no torch).

* :func:`majority_vote` — the ``m``-vote majority exactly as OpenClaw-RL
  (``openclaw-rl/openclaw_api_server.py``: ``_majority_vote``).
* :func:`decided_outcome`, :func:`votes_to_request`, :func:`run_votes` — **adaptive
  voting**: request judge votes in the smallest batches that can still change the
  outcome and stop as soon as the majority is decided. It is *exact*: for every
  possible sequence of votes over ``{1, 0, -1, None}`` the result equals
  ``majority_vote`` of all ``m`` votes (proved below and tested exhaustively).

Parsing a vote from the judge's answer is :mod:`scoring_workers.judge.prompts`.

Adaptive voting, why it is exact
--------------------------------
``majority_vote`` drops ``None`` (failed or unparseable votes), returns ``0.0`` when
nothing is left, the most common value when it is unique, and ``0.0`` on a tie for
the top count. After some votes with counts ``c[1], c[0], c[-1]`` and ``r`` votes
still to come, the outcome is **decided** iff it is the same for every completion of
the ``r`` remaining votes:

* it is certainly ``v in {1, -1}`` iff ``c[v] > c[w] + r`` for both other values
  ``w`` (the worst completion gives all ``r`` votes to one rival; ``None`` votes
  change no count);
* it is certainly ``0.0`` iff for both ``v in {1, -1}``,
  ``c[v] + r <= max(c[w] for w != v)`` (the completion most favourable to ``v``
  gives it all ``r`` votes; if ``v`` still does not beat every rival it never wins
  alone, and an outcome that is never ``1`` nor ``-1`` is always ``0.0``).

These two conditions are necessary and sufficient, so stopping when one holds never
changes the result. Among the strategies that look at votes one at a time, none
can stop earlier; :func:`votes_to_request` batches the votes that every such
strategy would have to request anyway (the fewest further votes after which the
outcome *could* be decided), so the number of calls equals the one-at-a-time
optimum while the latency is that of a few parallel rounds. For ``m = 3``: ask two;
if they agree (``1,1`` / ``0,0`` / ``-1,-1``) skip the third.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from infra.config import ConfigError

__all__ = [
    "Vote",
    "VoteResult",
    "decided_outcome",
    "gather_or_cancel",
    "majority_vote",
    "run_votes",
    "votes_to_request",
]


def majority_vote(votes: Sequence[int | None]) -> float:
    """OpenClaw-RL's majority: drop ``None``; none left -> ``0.0``; the most common
    value wins; a tie for the top count -> ``0.0``."""
    counter = Counter(v for v in votes if v is not None)
    if not counter:
        return 0.0
    (top_value, top_count), *_ = counter.most_common(1)
    if sum(1 for count in counter.values() if count == top_count) > 1:
        return 0.0
    return float(top_value)


class Vote(NamedTuple):
    """One judge call: the parsed score (``None`` = no valid vote), the judge's text
    (``None`` when the call failed) and the error description (``None`` on success)."""

    score: int | None
    text: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class VoteResult:
    """Outcome of :func:`run_votes` (votes are in request order)."""

    score: float
    votes: tuple[Vote, ...]
    budget: int
    escalated: bool = False

    @property
    def calls(self) -> int:
        return len(self.votes)

    @property
    def saved(self) -> int:
        """Calls not made compared with always asking ``budget`` (= ``m``) votes."""
        return max(0, self.budget - len(self.votes))

    @property
    def errors(self) -> int:
        return sum(1 for v in self.votes if v.error is not None)

    @property
    def invalid(self) -> int:
        """Calls that answered but whose answer held no valid score."""
        return sum(1 for v in self.votes if v.error is None and v.score is None)

    @property
    def all_failed(self) -> bool:
        """No valid vote at all (every call errored or was unparseable)."""
        return all(v.score is None for v in self.votes)

    def deciding(self) -> tuple[int, ...]:
        """Indices of the votes that carry the outcome: those equal to a unique
        majority, or every valid vote when the outcome is a tie / no majority."""
        valid = [i for i, v in enumerate(self.votes) if v.score is not None]
        if not valid:
            return ()
        counter = Counter(self.votes[i].score for i in valid)
        top_value, top_count = counter.most_common(1)[0]
        if sum(1 for count in counter.values() if count == top_count) == 1:
            return tuple(i for i in valid if self.votes[i].score == top_value)
        return tuple(valid)


def _counts(votes: Sequence[int | None]) -> tuple[int, int, int]:
    c = Counter(v for v in votes if v is not None)
    return c[1], c[0], c[-1]


def decided_outcome(counts: tuple[int, int, int], remaining: int) -> float | None:
    """The outcome if it no longer depends on the ``remaining`` votes, else ``None``.

    ``counts`` are the numbers of valid ``(1, 0, -1)`` votes so far (see the module
    docstring for why the two conditions are exact).
    """
    c = {1: counts[0], 0: counts[1], -1: counts[2]}
    for v in (1, -1):
        if all(c[v] > c[w] + remaining for w in c if w != v):
            return float(v)
    if all(c[v] + remaining <= max(c[w] for w in c if w != v) for v in (1, -1)):
        return 0.0
    return None


@lru_cache(maxsize=4096)
def votes_to_request(counts: tuple[int, int, int], remaining: int) -> int:
    """The fewest further votes after which the outcome *could* be decided.

    ``0`` when it is decided already. Every vote-at-a-time strategy must make at
    least this many more calls, so requesting them in one parallel batch costs no
    extra call.
    """
    if decided_outcome(counts, remaining) is not None:
        return 0
    c1, c0, cm = counts
    for b in range(1, remaining + 1):
        for a1 in range(b + 1):
            for a0 in range(b - a1 + 1):
                for am in range(b - a1 - a0 + 1):  # the rest of the b votes are None
                    if decided_outcome((c1 + a1, c0 + a0, cm + am), remaining - b) is not None:
                        return b
    return remaining  # unreachable: with nothing remaining the outcome is decided


async def gather_or_cancel(coros: Sequence[Awaitable[Any]]) -> list[Any]:
    """Run ``coros`` concurrently; on the first exception cancel the rest, wait for them,
    and re-raise that exception itself (not wrapped in an ``ExceptionGroup``)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _is_split(votes: Sequence[int | None]) -> bool:
    counter = Counter(v for v in votes if v is not None)
    if not counter:
        return False
    top = counter.most_common(1)[0][1]
    return sum(1 for count in counter.values() if count == top) > 1


async def run_votes(
    request: Callable[[int], Awaitable[Vote | int | None]],
    m: int,
    *,
    adaptive: bool = True,
    max_votes: int | None = None,
) -> VoteResult:
    """Collect judge votes and return their majority.

    ``request(i)`` makes vote number ``i`` (0-based, in request order) and returns a
    :class:`Vote` (or a bare score / ``None``). It should turn transport failures
    into ``Vote(None, None, error)``; an exception it raises propagates as is (sibling
    requests of the same batch are cancelled).

    * ``adaptive=False``: ``m`` votes in parallel, ``majority_vote`` of them
      (OpenClaw-RL).
    * ``adaptive=True``: votes in batches of :func:`votes_to_request`, stopping as
      soon as :func:`decided_outcome` holds. Same result as the fixed mode for every
      vote sequence; fewer calls when the judge agrees with itself.
    * ``max_votes > m`` (escalation, optional, off by default): if after all ``m``
      votes the valid votes are *split* (several values share the top count — e.g.
      ``1, 0, -1`` — which would give ``0.0`` for lack of a majority), ask one more
      vote at a time until the split is broken or ``max_votes`` votes were made; the
      result is the majority of all votes. This deliberately differs from the fixed
      ``m``-vote rule (it resolves ties instead of zeroing them).
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"m must be an integer >= 1, got {m!r}")
    limit = m if max_votes is None else max_votes
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < m:
        raise ConfigError(f"max_votes must be an integer >= m ({m}), got {max_votes!r}")

    votes: list[Vote] = []

    async def batch(k: int) -> None:
        start = len(votes)
        for value in await gather_or_cancel([request(start + j) for j in range(k)]):
            votes.append(value if isinstance(value, Vote) else Vote(value))

    if not adaptive:
        await batch(m)
    else:
        while True:
            need = votes_to_request(_counts([v.score for v in votes]), m - len(votes))
            if need == 0:
                break
            await batch(need)
    escalated = False
    while len(votes) < limit and _is_split([v.score for v in votes]):
        escalated = True
        await batch(1)
    score = majority_vote([v.score for v in votes])
    return VoteResult(score=score, votes=tuple(votes), budget=m, escalated=escalated)
