"""Turning a group's stored decision into its :class:`GroupVerdict` (AReaL's Process Rewards "v2 Export").

:func:`assemble_verdict` is a pure function of what the ledger stored, so every worker
that (re)publishes a group's verdict produces the same bytes — the trainer's dedupe on
``(experiment_id, group_id, verdict_version)`` then sees one verdict however often it is redelivered.

Rules (each sets ``reason_code`` from :mod:`infra.reasons`; ``reason`` is the text):
* ``discard`` decision -> ``discarded``; members are listed without results.
* ``invalid`` decision (a member's record was dead-lettered) -> ``rejected`` with the
  stored ``invalid_member: ...`` reason (it names the dead letter's coordinates).
* members reporting different ``group_size`` values -> ``rejected`` / ``group_size_mismatch``.
* any failed member -> ``rejected`` with that member's error code (first by
  trajectory id) as ``reason_code``; ``reason`` names the member and says why
  (``"<code>: member '<trajectory>' (session '<session>'): <error_detail>"``, plus
  ``"; N more member(s) failed"`` when others did); successful members keep their
  stats, the failed one has none. A failed member decides its group when it is parked
  (decision ``failed``), so the members listed are those parked by then.
* fewer members than ``group_size`` -> ``rejected`` / ``missing_sessions``.
* otherwise ``accepted``.

A ``reason`` quoting a record's text (a discard's own reason, a dead letter's error, a failed
member's error detail) quotes it escaped (:func:`infra.escape.printable`): one line, no
terminal escapes, for every reader that prints it.

:func:`fit_verdict` encodes a verdict and chooses the form its record takes; the worker
publishes what it returns. A verdict whose record would exceed ``kafka.max_message_bytes``
(:func:`infra.kafka.max_record_size`: the record batch, compressed, must fit the limit)
goes by reference when it may (``worker.verdict_tokens: auto``, the default:
:func:`referenced_verdict`, members' record coordinates instead of their turns, which
every verdict reader reads back), and otherwise — or when even that does not fit — as
:func:`too_large_verdict`: ``rejected`` / ``verdict_too_large`` with the sizes in the
reason, members' stats kept and their token turns dropped. All of them are pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from infra import reasons
from infra.escape import printable
from infra.kafka import max_record_size, record_size
from infra.readback import failed_reason, reference
from infra.schema import GroupVerdict, ScorerInfo, SessionResult, TokenRef, VerdictStatus, encode
from scoring_workers.ledger import GroupState, ParkedMember

VERDICT_VERSION = 1
_SCORERS = msgspec.msgpack.Decoder(list[ScorerInfo])


def encode_scorers(scorers: list[ScorerInfo]) -> bytes:
    return msgspec.msgpack.encode(scorers)


def assemble_verdict(group_id: str, state: GroupState, members: Sequence[SessionResult | ParkedMember]) -> GroupVerdict:
    """The verdict for a stored decision. Parked members (:class:`ParkedMember`) stand for
    their results as parked (no token turns); the worker passes sessions with turns."""
    results: list[SessionResult] = sorted(
        (m.result if isinstance(m, ParkedMember) else m for m in members), key=lambda m: m.trajectory_id
    )
    group_size = state.group_size
    status: VerdictStatus
    decision = state.decision or "complete"
    failed = [m for m in results if m.status == "failed"]
    code = ""
    if decision == "discard":
        status, code, reason = "discarded", reasons.DISCARDED, printable(state.discard_reason) or "discarded"
        results = [
            msgspec.structs.replace(m, status="discarded", branches=[], turn_results=[], stats={}, turns=[])
            for m in results
        ]
    elif decision == "invalid":
        status, code, reason = "rejected", reasons.INVALID_MEMBER, printable(state.discard_reason) or "invalid_member"
    elif state.size_mismatch is not None:
        status, code = "rejected", reasons.GROUP_SIZE_MISMATCH
        reason = f"group_size_mismatch: members disagree on group_size ({group_size} vs {state.size_mismatch})"
    elif failed:
        status, code, reason = "rejected", failed[0].failure_code, failed_reason(failed)
    elif len(results) < group_size:
        status, code = "rejected", reasons.MISSING_SESSIONS
        reason = f"missing_sessions: {len(results)} of {group_size} arrived before the deadline"
    else:
        status, reason = "accepted", ""
    first_seen, decided_at = state.first_seen, state.decided_at
    scorers = _SCORERS.decode(state.scorers) if state.scorers else []
    return GroupVerdict(
        group_id=group_id,
        status=status,
        reason=reason,
        verdict_version=VERDICT_VERSION,
        group_size=group_size,
        sessions=results,
        scorers=scorers,
        worker_id=state.decided_by,
        decided_at=decided_at / 1000.0,
        timings={"group_open_s": max(0, decided_at - first_seen) / 1000.0},
        reason_code=code,
    )


def too_large_verdict(verdict: GroupVerdict, *, size: int, limit: int, level: int = 1) -> GroupVerdict:
    """``verdict`` as ``rejected`` / ``verdict_too_large``, shrunk so that it can be published.

    ``level`` 1 drops the members' token turns (the bulk) and channels; 2 also drops
    branches and turn results; 3 also truncates error texts. Stats, statuses and ids
    always stay, so the trainer sees which group failed and why.
    """
    was = f"; it was {verdict.status}" + (f" ({verdict.reason_code})" if verdict.reason_code else "")
    what = {
        1: "token turns",
        2: "token turns, branches and turn results",
        3: "token turns, branches, turn results and error details",
    }[level]
    reason = (
        f"verdict_too_large: the verdict is {size} bytes, over the {max_record_size(limit)} a record may "
        f"have under kafka.max_message_bytes={limit} "
        f"({len(verdict.sessions)} sessions){was}; {what} dropped, stats kept"
    )

    def shrink(m: SessionResult) -> SessionResult:
        if level == 1:
            branches = [msgspec.structs.replace(b, channels={}) for b in m.branches]
            return msgspec.structs.replace(m, turns=[], branches=branches)
        error = m.error[:200] if level >= 3 and m.error else m.error
        return msgspec.structs.replace(m, turns=[], branches=[], turn_results=[], error=error)

    return msgspec.structs.replace(
        verdict,
        status="rejected",
        reason=reason,
        reason_code=reasons.VERDICT_TOO_LARGE,
        sessions=[shrink(m) for m in verdict.sessions],
    )


def referenced_verdict(verdict: GroupVerdict, refs: Mapping[str, TokenRef]) -> GroupVerdict:
    """``verdict`` with each scored member that carries turns and has a record in ``refs``
    (by trajectory id) naming that record instead (``tokens_at``): what
    ``worker.verdict_tokens: reference`` publishes. Everything else is unchanged."""

    def by_reference(m: SessionResult) -> SessionResult:
        ref = refs.get(m.trajectory_id)
        if ref is None or m.status != "scored" or not m.turns:
            return m
        return reference(m, ref.partition, ref.offset)

    return msgspec.structs.replace(verdict, sessions=[by_reference(m) for m in verdict.sessions])


def fit_verdict(
    verdict: GroupVerdict,
    limit: int,
    refs: Mapping[str, TokenRef] | None = None,
) -> tuple[GroupVerdict, bytes, list[tuple[str, bytes]]]:
    """``verdict`` encoded as a record; when the record would exceed what ``limit``
    (``kafka.max_message_bytes``) lets a record be (:func:`infra.kafka.max_record_size`:
    room for the batch framing and compression's worst case, so that the broker does not
    refuse an incompressible verdict sized to the limit itself): with ``refs`` (``worker.verdict_tokens: auto``, the
    members' record coordinates by trajectory id) the :func:`referenced_verdict` if that
    fits, else the smallest :func:`too_large_verdict` level that fits. A pure function of
    its arguments, so every worker that publishes the group sends the same bytes."""
    key = verdict.group_id.encode()
    value, headers = encode(verdict)
    size = record_size(key, value, headers)
    safe = max_record_size(limit)
    if size <= safe:
        return verdict, value, headers
    if refs and any(m.turns and m.status == "scored" and m.trajectory_id in refs for m in verdict.sessions):
        referenced = referenced_verdict(verdict, refs)
        ref_value, ref_headers = encode(referenced)
        if record_size(key, ref_value, ref_headers) <= safe:
            return referenced, ref_value, ref_headers
    for level in (1, 2, 3):
        small = too_large_verdict(verdict, size=size, limit=limit, level=level)
        value, headers = encode(small)
        if record_size(key, value, headers) <= safe:
            break
    return small, value, headers
