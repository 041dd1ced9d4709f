"""The audit's pure comparison (prm_pipeline.audit): verdict members vs re-scoring results.

"Recorded" members are produced exactly as the worker produces them (``rescore`` runs
the real PRMRunner on synthetic trajectories) and then edited by hand, so every test
compares realistic wire structs.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from infra.config import PRMConfig
from infra.schema import (
    DiscardGroup,
    GroupVerdict,
    ScorerInfo,
    SessionResult,
    TokenRewards,
    encode,
)
from prm_pipeline.audit import (
    ATOL,
    RTOL,
    Auditor,
    ScoringScope,
    Tolerance,
    compare_group,
    compare_session,
    parse_offsets,
    rescore,
    scorer_is_deterministic,
)
from prm_pipeline.demo.synthetic import make_session
from prm_pipeline.verdict_dump import parse_time
from scoring_workers.prm import BaseScorer, PRMRunner
from scoring_workers.scorers import LengthBudgetScorer


class RampScorer(BaseScorer):
    """Dense, deterministic: token k of a turn gets k / output_len."""

    name = "ramp"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> torch.Tensor:
        n = interaction.model_response.output_len
        return torch.arange(n, dtype=torch.float32) / n


class SamplingJudge(BaseScorer):
    """Stands in for an LLM judge: deterministic only when it does not sample."""

    name = "judge"

    def __init__(self, weight: float = 1.0, enabled: bool = True, temperature: float = 0.6) -> None:
        super().__init__(weight=weight, enabled=enabled)
        self.temperature = temperature

    @property
    def deterministic(self) -> bool:  # type: ignore[override]
        return self.temperature == 0

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return 0.25


class Boom(BaseScorer):
    name = "boom"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        raise RuntimeError("scripted failure")


def _traj(gid: str, k: int, *, turns: int = 2, branch_at: int | None = None, output_tokens: int = 16):
    return make_session(
        trajectory_id=f"{gid}-{k}",
        session_id=f"{gid}-s{k}",
        group_id=gid,
        group_size=2,
        turns=turns,
        output_tokens=output_tokens,
        branch_at=branch_at,
        rng=np.random.default_rng(k),
    )


async def _scored(scorers: list[BaseScorer], trajs) -> list[SessionResult]:
    runner = await PRMRunner.create(PRMConfig(scorers=scorers))  # type: ignore[arg-type]
    try:
        return [await rescore(runner, t, timeout_s=10) for t in trajs]
    finally:
        await runner.aclose()


def _verdict(gid: str, sessions: list[SessionResult], names: list[str], **kw: Any) -> GroupVerdict:
    failed = [s for s in sessions if s.status == "failed"]
    status = kw.pop("status", "rejected" if failed else "accepted")
    reason = kw.pop("reason", failed[0].failure_code if failed else "")
    return GroupVerdict(
        group_id=gid,
        status=status,
        reason=reason,
        group_size=len(sessions),
        sessions=sessions,
        scorers=[ScorerInfo(n, "1") for n in names],
        worker_id="w0",
        **kw,
    )


def _with_token_rewards(session: SessionResult, leaf: str, iid: str, values: np.ndarray) -> SessionResult:
    branches = []
    for b in session.branches:
        if b.leaf_id == leaf:
            b = msgspec.structs.replace(b, token_rewards={**b.token_rewards, iid: TokenRewards.from_array(values)})
        branches.append(b)
    return msgspec.structs.replace(session, branches=branches)


@pytest.fixture
async def group() -> tuple[str, list, list[SessionResult]]:
    gid = "g-audit"
    trajs = [_traj(gid, 0, branch_at=0), _traj(gid, 1, output_tokens=64)]
    return gid, trajs, await _scored([LengthBudgetScorer(max_output_tokens=32)], trajs)


LB = ScoringScope.of(["length_budget"])


# --------------------------------------------------------------------------- identical
async def test_identical_when_rescoring_reproduces_the_verdict(group) -> None:
    gid, trajs, recorded = group
    rescored = {s.trajectory_id: s for s in await _scored([LengthBudgetScorer(max_output_tokens=32)], trajs)}
    finding = compare_group([_verdict(gid, recorded, ["length_budget"])], rescored, scope=LB)
    assert finding.outcome == "identical", finding.differences
    assert finding.sessions == {"identical": 2} and finding.max_abs_diff is None
    assert finding.differences == [] and finding.status == "accepted"


async def test_dense_scorers_are_identical_too() -> None:
    trajs = [_traj("g-dense", 0, branch_at=0), _traj("g-dense", 1)]

    def scorers() -> list:
        return [LengthBudgetScorer(max_output_tokens=32), RampScorer(weight=0.5)]

    recorded, again = await _scored(scorers(), trajs), await _scored(scorers(), trajs)
    assert recorded[0].branches[0].token_rewards["g-dense-s0-t0"].values_raw is not None  # really dense
    finding = compare_group(
        [_verdict("g-dense", recorded, ["length_budget", "ramp"])],
        {s.trajectory_id: s for s in again},
        scope=ScoringScope.of(["length_budget", "ramp"]),
    )
    assert finding.outcome == "identical", finding.differences


# --------------------------------------------------------------------------- a changed token reward
async def test_changed_token_reward_names_group_session_turn_scorer_and_max_diff(group) -> None:
    gid, _trajs, recorded = group
    rescored = {s.trajectory_id: s for s in recorded}
    session = recorded[0]
    branch = session.branches[1]  # second branch of the forked session
    iid = branch.path[-1]
    values = branch.token_rewards[iid].to_numpy().copy()
    values[3] -= 0.375
    forged = _with_token_rewards(session, branch.leaf_id, iid, values)
    finding = compare_group([_verdict(gid, [forged, recorded[1]], ["length_budget"])], rescored, scope=LB)
    assert finding.outcome == "differs" and finding.group_id == gid
    assert finding.sessions == {"differs": 1, "identical": 1}
    (diff,) = finding.differences
    assert diff.kind == "token_rewards"
    assert (diff.trajectory_id, diff.session_id) == (session.trajectory_id, session.session_id)
    assert (diff.leaf_id, diff.turn, diff.scorer, diff.index) == (branch.leaf_id, iid, "length_budget", 3)
    assert diff.max_abs_diff == pytest.approx(0.375) and finding.max_abs_diff == pytest.approx(0.375)
    assert (diff.recorded, diff.rescored) == (pytest.approx(0.625), pytest.approx(1.0))
    assert diff.verdict_version == 1 and diff.variant == 0


async def test_changed_turn_result_total_and_stats_are_attributed_to_their_scorer() -> None:
    trajs = [_traj("g-two", 0), _traj("g-two", 1)]

    def scorers() -> list:
        return [LengthBudgetScorer(max_output_tokens=32), RampScorer()]

    recorded = await _scored(scorers(), trajs)
    rescored = {s.trajectory_id: s for s in await _scored(scorers(), trajs)}
    s = recorded[1]
    (branch,) = s.branches
    iid = branch.path[0]
    ramp_results = [tr for tr in s.turn_results if tr.scorer_name == "ramp" and tr.interaction_id == iid]
    turn_results = [
        msgspec.structs.replace(tr, reward=tr.reward + 0.1) if tr is ramp_results[0] else tr for tr in s.turn_results
    ]
    tokens = branch.token_rewards[iid].to_numpy() + np.float32(0.1)
    forged = msgspec.structs.replace(
        _with_token_rewards(s, branch.leaf_id, iid, tokens),
        turn_results=turn_results,
        stats={**s.stats, "rollout/prm_turn_reward/ramp": s.stats["rollout/prm_turn_reward/ramp"] + 0.05},
    )
    finding = compare_group(
        [_verdict("g-two", [recorded[0], forged], ["length_budget", "ramp"])],
        rescored,
        scope=ScoringScope.of(["length_budget", "ramp"]),
    )
    assert finding.outcome == "differs"
    kinds = {(d.kind, d.turn, d.scorer) for d in finding.differences}
    assert ("turn_result", iid, "ramp") in kinds
    assert ("token_rewards", iid, "ramp") in kinds  # attributed through the differing turn result
    stats = [d for d in finding.differences if d.kind == "stats"]
    assert [(d.key, d.scorer) for d in stats] == [("rollout/prm_turn_reward/ramp", "ramp")]
    assert all(d.session_id == forged.session_id for d in finding.differences)


# --------------------------------------------------------------------------- tolerance
def test_tolerance_defaults_are_documented_values() -> None:
    assert (Tolerance().rtol, Tolerance().atol) == (RTOL, ATOL) == (1e-5, 1e-6)
    with pytest.raises(ValueError):
        Tolerance(rtol=-1.0)


async def test_float32_round_off_is_tolerated_but_real_changes_are_not(group) -> None:
    gid, _trajs, recorded = group
    rescored = {s.trajectory_id: s for s in recorded}
    session = recorded[1]
    (branch,) = session.branches
    iid = branch.path[0]
    base = np.full(branch.token_rewards[iid].length, 0.1, dtype=np.float32)
    # the same rewards re-scored on another CPU: a few ULPs away
    ulps = base.copy()
    for _ in range(4):
        ulps = np.nextafter(ulps, np.float32(1), dtype=np.float32)
    ulps[0] = base[0]  # keep it dense (not uniform)
    rec = _with_token_rewards(session, branch.leaf_id, iid, base)
    res = _with_token_rewards(session, branch.leaf_id, iid, ulps)
    assert not np.array_equal(
        rec.branches[0].token_rewards[iid].to_numpy(), res.branches[0].token_rewards[iid].to_numpy()
    )
    assert compare_session(rec, res, scope=LB).outcome == "identical"
    # near zero the absolute tolerance applies
    tiny = _with_token_rewards(session, branch.leaf_id, iid, np.full(base.size, 5e-7, dtype=np.float32))
    zero = _with_token_rewards(session, branch.leaf_id, iid, np.zeros(base.size, dtype=np.float32))
    assert compare_session(tiny, zero, scope=LB).outcome == "identical"
    # a change of 1e-4 is a difference; bit equality can be demanded
    moved = _with_token_rewards(session, branch.leaf_id, iid, base + np.float32(1e-4))
    cmp = compare_session(moved, rec, scope=LB)
    assert cmp.outcome == "differs" and cmp.differences[0].max_abs_diff == pytest.approx(1e-4, rel=1e-2)
    assert compare_session(rec, res, scope=LB, tol=Tolerance(rtol=0, atol=0)).outcome == "differs"
    finding = compare_group(
        [_verdict(gid, [recorded[0], rec], ["length_budget"])], {**rescored, session.trajectory_id: res}, scope=LB
    )
    assert finding.outcome == "identical"


# --------------------------------------------------------------------------- missing trajectory / discards
async def test_missing_trajectory_is_verdict_without_trajectory(group) -> None:
    gid, _trajs, recorded = group
    only_one = {recorded[0].trajectory_id: recorded[0]}
    finding = compare_group([_verdict(gid, recorded, ["length_budget"])], only_one, scope=LB)
    assert finding.outcome == "verdict_without_trajectory"
    assert finding.sessions == {"identical": 1, "missing_trajectory": 1}
    assert any(recorded[1].trajectory_id in n for n in finding.notes)
    # a difference elsewhere in the group still wins
    forged = msgspec.structs.replace(recorded[0], outcome_reward=5.0)
    finding = compare_group([_verdict(gid, [forged, recorded[1]], ["length_budget"])], only_one, scope=LB)
    assert finding.outcome == "differs"
    assert [(d.kind, d.key) for d in finding.differences] == [("field", "outcome_reward")]


async def test_discarded_group_needs_its_discard_record(group) -> None:
    gid, _trajs, recorded = group
    members = [
        msgspec.structs.replace(s, status="discarded", branches=[], turn_results=[], stats={}, turns=[])
        for s in recorded
    ]
    verdict = _verdict(gid, members, ["length_budget"], status="discarded", reason="prompt filtered")
    assert compare_group([verdict], {}, scope=LB, discard_seen=True).outcome == "identical"
    assert compare_group([verdict], {}, scope=LB, discard_seen=False).outcome == "verdict_without_trajectory"
    leaky = _verdict(gid, [recorded[0], members[1]], ["length_budget"], status="discarded", reason="x")
    finding = compare_group([leaky], {}, scope=LB, discard_seen=True)
    assert finding.outcome == "differs"  # a discarded verdict with a scored member


# --------------------------------------------------------------------------- failed members
async def test_failed_members_must_fail_again_with_the_same_code() -> None:
    trajs = [_traj("g-fail", 0), _traj("g-fail", 1)]
    recorded = await _scored([LengthBudgetScorer(max_output_tokens=32), Boom()], trajs)
    assert [s.status for s in recorded] == ["failed", "failed"] and recorded[0].error.startswith("scorer_error:")
    assert (recorded[0].error_code, recorded[0].error_scorer) == ("scorer_error", "boom")  # typed, not parsed
    assert recorded[0].branches == [] and recorded[0].turns == []  # no partial results, like the worker
    scope = ScoringScope.of(["length_budget", "boom"])
    verdict = _verdict("g-fail", recorded, ["length_budget", "boom"])
    again = {s.trajectory_id: s for s in await _scored([LengthBudgetScorer(max_output_tokens=32), Boom()], trajs)}
    assert compare_group([verdict], again, scope=scope).outcome == "identical"
    # the scorer stopped failing: re-scoring succeeds -> differs, naming the scorer from the recorded error
    fixed = await _scored([LengthBudgetScorer(max_output_tokens=32)], trajs)
    finding = compare_group([verdict], {s.trajectory_id: s for s in fixed}, scope=scope)
    assert finding.outcome == "differs"
    assert {(d.kind, d.scorer) for d in finding.differences} == {("status", "boom")}
    # the culprit comes from the typed field: a message that names another scorer changes nothing
    misleading = [msgspec.structs.replace(s, error="scorer_error: scorer 'length_budget' said so") for s in recorded]
    finding = compare_group(
        [_verdict("g-fail", misleading, ["length_budget", "boom"])], {s.trajectory_id: s for s in fixed}, scope=scope
    )
    assert {(d.kind, d.scorer) for d in finding.differences} == {("status", "boom")}
    # a recorded timeout that does not reproduce is load, not a finding
    timed_out = [
        msgspec.structs.replace(
            s,
            error="scorer_timeout: TimeoutError",
            error_code="scorer_timeout",
            error_scorer=None,
            error_detail="TimeoutError",
        )
        for s in recorded
    ]
    finding = compare_group(
        [_verdict("g-fail", timed_out, ["length_budget", "boom"])], {s.trajectory_id: s for s in fixed}, scope=scope
    )
    assert finding.outcome == "not_rescorable"
    # scored in the verdict, rejected now
    scored = {s.trajectory_id: s for s in fixed}
    finding = compare_group([_verdict("g-fail", fixed, ["length_budget", "boom"])], again, scope=scope)
    assert finding.outcome == "differs"
    assert finding.differences[0].kind == "status" and finding.differences[0].scorer == "boom"
    assert scored  # (kept for readability)


# --------------------------------------------------------------------------- non-deterministic scorers
def test_scorer_determinism_is_declared() -> None:
    assert scorer_is_deterministic(LengthBudgetScorer())  # BaseScorer's default
    assert not scorer_is_deterministic(SamplingJudge(temperature=0.6))
    assert scorer_is_deterministic(SamplingJudge(temperature=0.0))

    class Off(LengthBudgetScorer):
        name = "off"
        deterministic = False

    assert not scorer_is_deterministic(Off())


async def test_non_deterministic_scorer_is_checked_against_the_record_not_rerun() -> None:
    from prm_pipeline.audit import build_runners

    trajs = [_traj("g-judge", 0, branch_at=0), _traj("g-judge", 1)]
    recorded = await _scored([LengthBudgetScorer(max_output_tokens=32), SamplingJudge()], trajs)
    prm = PRMConfig(scorers=[LengthBudgetScorer(max_output_tokens=32), SamplingJudge()])  # type: ignore[list-item]
    scope, runner, owned = await build_runners(prm)
    try:
        assert scope.rescored == {"length_budget"} and scope.not_rescored == {"judge"}
        assert [s.name for s in scope.scorers] == ["length_budget", "judge"]
        rescored = {t.trajectory_id: await rescore(runner, t, timeout_s=10) for t in trajs}
    finally:
        for r in owned:
            await r.aclose()
    assert all("rollout/prm_turn_reward/judge" not in s.stats for s in rescored.values())  # judge not called
    verdict = _verdict("g-judge", recorded, ["length_budget", "judge"])
    finding = compare_group([verdict], rescored, scope=scope)
    assert finding.outcome == "not_rescorable", finding.differences
    assert finding.sessions == {"not_rescorable": 2}
    # a forged token reward is still caught through the judge's recorded turn reward
    s = recorded[0]
    branch = s.branches[0]
    iid = branch.path[0]
    forged = _with_token_rewards(s, branch.leaf_id, iid, branch.token_rewards[iid].to_numpy() + np.float32(0.5))
    finding = compare_group(
        [_verdict("g-judge", [forged, recorded[1]], ["length_budget", "judge"])], rescored, scope=scope
    )
    assert finding.outcome == "differs"
    (diff,) = finding.differences
    assert (diff.kind, diff.turn, diff.scorer) == ("token_rewards", iid, "judge")
    assert diff.max_abs_diff == pytest.approx(0.5)
    # so is a deterministic scorer's changed turn result
    trs = [
        msgspec.structs.replace(tr, reward=0.5) if tr.scorer_name == "length_budget" and i == 0 else tr
        for i, tr in enumerate(s.turn_results)
    ]
    finding = compare_group(
        [_verdict("g-judge", [msgspec.structs.replace(s, turn_results=trs), recorded[1]], ["length_budget", "judge"])],
        rescored,
        scope=scope,
    )
    assert finding.outcome == "differs"
    assert ("turn_result", "length_budget") in {(d.kind, d.scorer) for d in finding.differences}


# --------------------------------------------------------------------------- duplicate / conflicting verdicts
async def test_duplicate_verdicts_are_compared_once_and_conflicts_are_findings(group) -> None:
    gid, _trajs, recorded = group
    rescored = {s.trajectory_id: s for s in recorded}
    verdict = _verdict(gid, recorded, ["length_budget"])
    copy = msgspec.msgpack.decode(msgspec.msgpack.encode(verdict), type=GroupVerdict)
    finding = compare_group([verdict, copy, verdict], rescored, scope=LB)
    assert finding.outcome == "identical"
    assert (finding.verdict_records, finding.distinct_verdicts, finding.sessions) == (3, 1, {"identical": 2})
    # another worker decided the same key differently
    other = msgspec.structs.replace(verdict, worker_id="w9", decided_at=5.0)
    finding = compare_group([verdict, other, verdict], rescored, scope=LB)
    assert finding.outcome == "differs" and finding.distinct_verdicts == 2
    (diff,) = finding.differences
    assert diff.kind == "conflicting_verdicts" and "decided_at" in diff.detail and "worker_id" in diff.detail
    # a newer verdict_version is a separate key, not a conflict
    v2 = msgspec.structs.replace(verdict, verdict_version=2)
    finding = compare_group([verdict, v2], rescored, scope=LB)
    assert finding.outcome == "identical" and finding.verdict_versions == [1, 2]


async def test_scorer_versions_and_self_contradictions_are_findings(group) -> None:
    gid, _trajs, recorded = group
    rescored = {s.trajectory_id: s for s in recorded}
    bumped = msgspec.structs.replace(
        _verdict(gid, recorded, ["length_budget"]), scorers=[ScorerInfo("length_budget", "2")]
    )
    assert [d.kind for d in compare_group([bumped], rescored, scope=LB).differences] == ["scorers"]
    short = _verdict(gid, recorded[:1], ["length_budget"], status="accepted")
    short = msgspec.structs.replace(short, group_size=2)
    assert [d.kind for d in compare_group([short], rescored, scope=LB).differences] == ["verdict"]


# --------------------------------------------------------------------------- the Auditor, without Kafka
async def test_auditor_matches_records_by_trajectory_id() -> None:
    trajs = [_traj("g-a", 0), _traj("g-a", 1), _traj("g-b", 0)]
    recorded = await _scored([LengthBudgetScorer(max_output_tokens=32)], trajs)
    verdict = _verdict("g-a", recorded[:2], ["length_budget"])
    forged = _with_token_rewards(
        recorded[0], recorded[0].branches[0].leaf_id, recorded[0].branches[0].path[0], np.zeros(16, dtype=np.float32)
    )
    conflicting = msgspec.structs.replace(verdict, sessions=[forged, recorded[1]])
    runner = await PRMRunner.create(PRMConfig(scorers=[LengthBudgetScorer(max_output_tokens=32)]))  # type: ignore[list-item]
    try:
        auditor = Auditor(scope=LB, runner=runner, concurrency=2)
        for v in (verdict, verdict, conflicting):
            auditor.feed_verdict(*encode(v))
        auditor.feed_verdict(b"junk", [("prm-schema-version", b"1"), ("prm-kind", b"verdict")])
        assert auditor.sessions_to_rescore == 2
        for message in (trajs[0], trajs[1], trajs[0], trajs[2], DiscardGroup(group_id="g-c")):
            await auditor.feed_trajectory(*encode(message))
        report = await auditor.finish()
    finally:
        await runner.aclose()
    found = report.by_group()
    assert found["g-a"].outcome == "differs" and found["g-a"].verdict_records == 3
    assert {d.kind for d in found["g-a"].differences} == {"token_rewards", "conflicting_verdicts"}
    assert {d.variant for d in found["g-a"].differences if d.kind == "token_rewards"} == {1}
    assert found["g-b"].outcome == "trajectory_without_verdict" and found["g-b"].trajectories == ["g-b-0"]
    assert found["g-c"].outcome == "trajectory_without_verdict"
    assert report.counts == {
        "identical": 0,
        "differs": 1,
        "not_rescorable": 0,
        "verdict_without_trajectory": 0,
        "trajectory_without_verdict": 2,
    }
    assert report.records["undecodable_verdicts"] == 1 and report.exit_code == 1


async def test_groups_asked_for_and_not_found_are_named_and_none_found_exits_2() -> None:
    """``--groups g-a g-typo``: the audit names ``g-typo``; with only ids that match nothing it
    audited nothing, which is exit 2, not a clean 0."""
    import io

    from prm_pipeline.audit import render_summary

    trajs = [_traj("g-a", 0)]
    recorded = await _scored([LengthBudgetScorer(max_output_tokens=32)], trajs)
    runner = await PRMRunner.create(PRMConfig(scorers=[LengthBudgetScorer(max_output_tokens=32)]))  # type: ignore[list-item]
    try:
        reports = []
        for groups in (["g-a", "g-typo", "g-a"], ["exmple-math", "g-typo"]):
            auditor = Auditor(scope=LB, runner=runner, groups=groups)
            auditor.feed_verdict(*encode(_verdict("g-a", recorded, ["length_budget"])))
            await auditor.feed_trajectory(*encode(trajs[0]))
            reports.append(await auditor.finish())
    finally:
        await runner.aclose()
    partial, none = reports
    assert partial.missing_groups == ["g-typo"] and partial.counts["identical"] == 1 and partial.exit_code == 0
    assert none.missing_groups == ["exmple-math", "g-typo"] and none.exit_code == 2
    out = io.StringIO()
    render_summary(partial, out)
    assert "--groups not found (1 of 2; no record in the range read names them): g-typo" in out.getvalue()
    out = io.StringIO()
    render_summary(none, out)
    assert "none of the --groups was found" in out.getvalue() and "exmple-math, g-typo" in out.getvalue()


# --------------------------------------------------------------------------- argument parsing
def test_parse_offsets_and_times() -> None:
    aliases = {"trajectories": "prm.trajectories", "verdicts": "prm.verdicts"}
    assert parse_offsets(["trajectories:0:10,trajectories:3:7", "prm.verdicts:1:0"], aliases=aliases) == {
        "prm.trajectories": {0: 10, 3: 7},
        "prm.verdicts": {1: 0},
    }
    for bad in ("x:1", "t:a:1", "t:1:-2"):
        with pytest.raises(ValueError):
            parse_offsets(bad)
    now = 1_800_000_000.0
    assert parse_time("15m", now=now) == (now - 900) * 1000
    assert parse_time("1d12h", now=now) == (now - 129_600) * 1000
    assert parse_time("2026-11-30T14:05:00Z", now=now) == 1_796_047_500_000
    assert parse_time("2026-11-30T15:05:00+01:00", now=now) == 1_796_047_500_000
    for bad in ("", "15", "yesterday", "2099-01-01"):
        with pytest.raises(ValueError):
            parse_time(bad, now=now)


async def test_auditor_reassembles_chunked_trajectories() -> None:
    """A long session travels as chunk records; the audit re-scores it once its last chunk arrives."""
    from infra.chunks import to_records
    from prm_pipeline.demo.synthetic import make_agent_session

    traj = make_agent_session(
        trajectory_id="g-long-0",
        session_id="g-long-s0",
        group_id="g-long",
        turns=12,
        context_tokens=12_000,
        output_tokens=16,
    )
    recorded = await _scored([LengthBudgetScorer(max_output_tokens=32)], [traj])
    runner = await PRMRunner.create(PRMConfig(scorers=[LengthBudgetScorer(max_output_tokens=32)]))  # type: ignore[list-item]
    try:
        auditor = Auditor(scope=LB, runner=runner)
        auditor.feed_verdict(*encode(_verdict("g-long", recorded, ["length_budget"])))
        records = to_records(traj, 16_384)
        assert len(records) > 2
        for value, headers in records:
            await auditor.feed_trajectory(value, headers)
        report = await auditor.finish()
    finally:
        await runner.aclose()
    assert report.by_group()["g-long"].outcome == "identical"
    assert report.records["trajectory_records"] == len(records)


async def test_auditor_counts_streamed_sessions_and_does_not_call_them_undecodable() -> None:
    """A streamed session's ``turn`` and ``end`` records decode: they are counted, their
    trajectory is seen in its group, and a verdict member naming it is ``not_rescorable``
    (the audit re-scores ready trajectories only), not ``missing_trajectory``."""
    import io

    from infra.schema import stream_session
    from prm_pipeline.audit import render_summary

    trajs = [_traj("g-s", 0), _traj("g-s", 1), _traj("g-t", 0)]
    recorded = await _scored([LengthBudgetScorer(max_output_tokens=32)], trajs[:2])
    runner = await PRMRunner.create(PRMConfig(scorers=[LengthBudgetScorer(max_output_tokens=32)]))  # type: ignore[list-item]
    try:
        auditor = Auditor(scope=LB, runner=runner)
        auditor.feed_verdict(*encode(_verdict("g-s", recorded, ["length_budget"])))
        await auditor.feed_trajectory(*encode(trajs[0]))  # member 0 as a ready record
        streamed = [m for t in trajs[1:] for turns, end in [stream_session(t)] for m in (*turns, end)]
        for message in streamed:  # member 1 streamed; g-t streamed without a verdict
            await auditor.feed_trajectory(*encode(message))
        report = await auditor.finish()
    finally:
        await runner.aclose()
    assert "undecodable_trajectories" not in report.records
    assert report.records["streamed_end_records"] == 2
    assert report.records["streamed_turn_records"] == len(streamed) - 2
    found = report.by_group()
    assert found["g-s"].outcome == "not_rescorable" and found["g-s"].sessions == {"identical": 1, "not_rescorable": 1}
    assert any("'g-s-1' was streamed" in n and "ready trajectories only" in n for n in found["g-s"].notes)
    assert found["g-t"].outcome == "trajectory_without_verdict" and found["g-t"].trajectories == ["g-t-0"]
    assert report.exit_code == 0
    out = io.StringIO()
    render_summary(report, out)
    text = " ".join(out.getvalue().split())
    assert f"streamed session records (counted, not re-scored): {len(streamed) - 2} turn, 2 end" in text
