"""How a worker's in-flight slots are shared between experiments: weighted, capped, work-conserving.

A worker scores at most ``worker.concurrency`` records at once. With several
experiments, one experiment's backlog must not take every slot: each *busy*
experiment (one with records in flight) gets a share of the slots proportional to its
weight, capped by its own ``max_in_flight`` quota; what a capped experiment cannot use
goes to the others (water-filling). One slot stays in reserve for the *idle* experiments
together (not one each: a worker serving twenty experiments must not idle twenty slots)
— the next record of any idle experiment finds it free, and once that record is in
flight its experiment is busy and gets its full share at the next poll; the busy
experiments, over their new shares, are paused until they are under them. So a lone
busy experiment uses every slot but one. The worker pauses the partitions of every experiment
at or over its share (:meth:`scoring_workers.admission.Admission.apply_backpressure`), which
is how one experiment's backlog waits in Kafka instead of in the worker.

This is weighted fair queuing at the granularity of a slot: with experiments A and B
of equal weight and A flooded, B's records wait for at most one A record to finish
before they are fetched, whatever A's backlog.

Pure arithmetic over plain numbers: unit-tested without Kafka (tests/unit/test_fair_share.py).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["slot_caps"]


def slot_caps(
    concurrency: int,
    weights: Mapping[str, float],
    in_flight: Mapping[str, int],
    quotas: Mapping[str, int | None] | None = None,
) -> dict[str, int]:
    """Each experiment's slot cap: it may fetch while its in-flight count is below it.

    ``weights`` names every experiment the worker serves (weight > 0); ``in_flight``
    their records in flight now (missing = 0); ``quotas`` their ``max_in_flight``
    (missing or None = no quota). Caps of busy experiments sum to at most
    ``concurrency`` minus the one reserved slot (when some experiment is idle); an idle
    experiment's cap is 1 (the shared reserve: whichever idle experiment's record comes
    first takes it; the worker's overall ``concurrency`` bound still holds).
    """
    quotas = quotas or {}
    idle = [e for e in weights if in_flight.get(e, 0) <= 0]
    busy = [e for e in weights if in_flight.get(e, 0) > 0]
    caps = {e: 1 for e in idle}
    free: float = max(len(busy), concurrency - (1 if idle else 0))  # a busy experiment always keeps at least one slot
    open_ = {e: float(quotas.get(e) or concurrency) for e in busy}
    shares: dict[str, float] = {}
    while open_:  # water-filling: hand out by weight, give what a quota cannot use to the others
        total = sum(weights[e] for e in open_)
        share = {e: free * weights[e] / total for e in open_}
        capped = {e for e in open_ if share[e] >= open_[e]}
        if not capped:
            shares.update(share)
            break
        for e in capped:
            shares[e] = open_.pop(e)
            free -= shares[e]
    for e in busy:
        caps[e] = max(1, int(shares.get(e, 1) + 1e-9))
    return caps
