"""Routing a judge call to one endpoint of a pool: session affinity, spill-over, breakers.

A judge scorer may list several replicas of the same judge (``base_urls``). Each call
goes to one of them, chosen by :func:`choose_endpoint` from what the process knows
about each endpoint — its *load* (attempts routed there and not finished), its recent
answer latency (an EWMA) and whether its circuit breaker admits a call. An endpoint's
*cost* is the time a new call would take there, ``(load + 1) x latency``: how far
behind it is, counted in calls of the endpoint it is compared with.

1. **Affinity.** Calls carrying a key (the trajectory's ``session_id``) prefer the
   endpoint that ranks first for that key by *rendezvous hashing*
   (:func:`rendezvous_order`: highest ``hash(key, endpoint)`` wins). One session's
   prompts — which share their prefix turn after turn — land on one replica and reuse
   its prefix (KV) cache; every worker computes the same ranking from the same list,
   and adding or removing a replica moves only the sessions that ranked it first.
2. **Breakers.** An endpoint whose breaker is open (or half-open with its probe out)
   is skipped; the session's next endpoint in rank order takes its calls (``detour``),
   so even a detour is consistent per session.
3. **Spill-over.** When the preferred endpoint is *overloaded* (:func:`overloaded`,
   under a :class:`~scoring_workers.judge.settings.SpillPolicy`) — its cost exceeds the
   cheapest available endpoint's by more than ``spill_in_flight`` of that endpoint's
   calls **and** by a factor above ``spill_ratio`` (the two thresholds of SGLang's
   router, which balances the same trade-off between cache hits and queueing; with
   equally fast replicas they compare plain in-flight counts), or it is at its
   concurrency cap while another is not — the call goes to the cheapest endpoint
   (``spill``). A replica ten times slower than the others keeps a session's call only
   while it has next to nothing in flight; a replica that is merely as busy as the
   others keeps its sessions.
4. **Failover.** A retry of a failed attempt avoids the endpoints that already failed
   for this call (``failover``) while another is available.
5. Calls without a key go to the cheapest available endpoint (``balanced``), ties
   broken round-robin.

An endpoint without a latency estimate yet counts as fast as the fastest known one,
so a new or recovered replica gets calls and is measured.

Pure functions over plain numbers: unit-tested exhaustively without HTTP
(``tests/unit/test_judge_pool.py``); :class:`~scoring_workers.judge.client.
JudgeClient` applies them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

from scoring_workers.judge.settings import SpillPolicy

__all__ = ["ROUTES", "SpillPolicy", "choose_endpoint", "overloaded", "rendezvous_order"]

ROUTES = ("affinity", "detour", "spill", "failover", "balanced")
"""Why a call went where it did (the ``route`` label of ``prm_judge_routed``)."""


_DEFAULT_POLICY = SpillPolicy()


def overloaded(
    policy: SpillPolicy,
    cost: float,
    least_cost: float,
    least_latency: float,
    least_load: int,
    *,
    at_cap: bool = False,
    least_at_cap: bool = False,
) -> bool:
    """Whether an endpoint whose next call would cost ``cost`` should shed it to the
    cheapest one (``least_*``) under ``policy``; costs are ``(load + 1) x latency``."""
    if at_cap and not least_at_cap:
        return True
    behind = cost / least_latency - (least_load + 1)  # in calls of the cheapest endpoint
    return behind > policy.spill_in_flight and cost > policy.spill_ratio * least_cost


def _score(key: str, endpoint: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{endpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, endpoints: Sequence[str]) -> tuple[int, ...]:
    """Indices of ``endpoints`` ranked for ``key``, best first (rendezvous hashing).

    Stable across processes and Python runs (BLAKE2b, not ``hash()``), so every worker
    sends a session to the same replica."""
    return tuple(sorted(range(len(endpoints)), key=lambda i: (-_score(key, endpoints[i]), i)))


def choose_endpoint(
    loads: Sequence[int],
    available: Sequence[bool],
    *,
    order: Sequence[int] | None = None,
    policy: SpillPolicy = _DEFAULT_POLICY,
    caps: Sequence[int] | None = None,
    latencies: Sequence[float | None] | None = None,
    avoid: Collection[int] = (),
    start: int = 0,
) -> tuple[int, str] | None:
    """``(endpoint index, route)`` for one call, or ``None`` when no endpoint is available.

    Args:
        loads: unfinished calls per endpoint (process-wide).
        available: whether each endpoint's circuit breaker admits a call.
        order: the call's rendezvous ranking (:func:`rendezvous_order`); ``None`` for a
            call without an affinity key.
        caps: each endpoint's concurrency cap (a call beyond it waits for a slot).
        latencies: each endpoint's recent answer latency (``None``: not measured yet,
            counts as the fastest measured); ``None`` for all: equally fast.
        avoid: endpoints that already failed for this call; skipped while another is
            available (then the route is ``failover``).
        start: round-robin offset that breaks ties between equally loaded endpoints.
    """
    n = len(loads)
    if len(available) != n or (order is not None and sorted(order) != list(range(n))):
        raise ValueError("loads, available and order must describe the same endpoints")
    candidates = [i for i in range(n) if available[i] and i not in avoid]
    failover = bool(avoid)
    if not candidates:
        candidates = [i for i in range(n) if available[i]]  # every available one failed already: retry anyway
        failover = False
    if not candidates:
        return None

    def at_cap(i: int) -> bool:
        return caps is not None and loads[i] >= caps[i]

    known = [x for x in latencies or () if x is not None and x > 0]
    fastest = min(known) if known else 1.0
    measured: list[float | None] = list(latencies) if latencies else [None] * n
    speed = [x if x is not None and x > 0 else fastest for x in measured[:n]]
    cost = [(loads[i] + 1) * speed[i] for i in range(n)]
    least = min(candidates, key=lambda i: (cost[i], (i - start) % n))
    if order is None:
        return least, "failover" if failover else "balanced"
    preferred = next(i for i in order if i in candidates)
    if preferred != least and overloaded(
        policy,
        cost[preferred],
        cost[least],
        speed[least],
        loads[least],
        at_cap=at_cap(preferred),
        least_at_cap=at_cap(least),
    ):
        return least, "failover" if failover else "spill"
    if failover:
        return preferred, "failover"
    return preferred, "affinity" if preferred == order[0] else "detour"
