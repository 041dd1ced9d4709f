"""infra.reasons: one registry for every verdict ``reason_code`` and member ``error_code``.

Checks that every decision and every failure path writes a registered code, that the
docs' table is the registry's rendering, and that no production module parses
``"code: detail"`` text any more.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from infra import reasons
from infra.readback import unavailable
from infra.schema import Interaction, ModelResponse, ReadyTrajectory, SessionResult
from scoring_workers.judge.errors import JudgeFailedError
from scoring_workers.ledger import GroupState
from scoring_workers.prm import PRMConfig, PRMRunner, failure_code, failure_detail
from scoring_workers.prm.errors import REJECTION_REASONS
from scoring_workers.scorers import LengthBudgetScorer
from scoring_workers.scoring import score_member
from scoring_workers.verdicts import assemble_verdict, too_large_verdict

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("infra", "scoring_workers", "shaper", "producers", "prm_pipeline")


def test_docs_reason_table_is_the_registry() -> None:
    text = (ROOT / "docs/wire.md").read_text()
    assert reasons.doc_block(text) == reasons.render_markdown(), (
        "docs/wire.md's reason table differs from infra/reasons.py: run `python -m infra.reasons docs/wire.md`"
    )


def test_builtin_codes_are_well_formed_and_cover_every_writer() -> None:
    codes = {r.code for r in reasons.registered()}
    assert all(reasons.CODE_PATTERN.fullmatch(c) for c in codes)
    assert REJECTION_REASONS <= {c for c in codes if reasons.is_member_code(c)}
    assert reasons.is_member_code(JudgeFailedError.reason)
    assert {
        "discarded",
        "invalid_member",
        "group_size_mismatch",
        "missing_sessions",
        "verdict_too_large",
        "tokens_unavailable",
        "not_concat_export",
        "scorer_timeout",
        "scorer_error",
    } <= codes


def test_register_is_idempotent_and_refuses_free_text_and_clashes() -> None:
    assert reasons.register("test_plugin_failed", "a test scorer's own failure") == "test_plugin_failed"
    assert reasons.register("test_plugin_failed", "again") == "test_plugin_failed"
    assert reasons.get("test_plugin_failed").builtin is False
    with pytest.raises(ValueError, match="must match"):
        reasons.register("environment crashed", "free text is not a code")
    with pytest.raises(ValueError, match="already registered"):
        reasons.register("missing_sessions", "a group decision, not a member failure")
    assert "test_plugin_failed" not in reasons.render_markdown()  # the docs list built-in codes only


def test_metric_labels_are_bounded() -> None:
    assert reasons.metric_label("accepted", "") == ""
    assert reasons.metric_label("rejected", "scorer_timeout") == "scorer_timeout"
    assert reasons.metric_label("rejected", "") == reasons.UNSPECIFIED
    assert reasons.metric_label("discarded", "environment crashed before turn 3") == reasons.OTHER
    assert reasons.metric_label("rejected", "never_registered_code") == reasons.OTHER


# --------------------------------------------------------------------------- group decisions
def _member(tid: str, status: str = "scored") -> SessionResult:
    return SessionResult(session_id=tid, trajectory_id=tid, status=status)  # type: ignore[arg-type]


_FAILED = SessionResult.failure(code="scorer_timeout", detail="took 30 s", session_id="s-f", trajectory_id="f")


@pytest.mark.parametrize(
    ("state", "members", "status", "code"),
    [
        (
            GroupState(decision="discard", discard_reason="environment crashed"),
            [_member("a")],
            "discarded",
            "discarded",
        ),
        (GroupState(decision="discard"), [], "discarded", "discarded"),
        (
            GroupState(decision="invalid", discard_reason="invalid_member: record t:0@5 was dead-lettered"),
            [],
            "rejected",
            "invalid_member",
        ),
        (
            GroupState(decision="complete", group_size=2, size_mismatch=3),
            [_member("a"), _member("b")],
            "rejected",
            "group_size_mismatch",
        ),
        (GroupState(decision="failed", group_size=3), [_member("a"), _FAILED], "rejected", "scorer_timeout"),
        (GroupState(decision="deadline", group_size=3), [_member("a")], "rejected", "missing_sessions"),
        (GroupState(decision="complete", group_size=1), [_member("a")], "accepted", ""),
    ],
)
def test_every_decision_carries_its_code(state, members, status, code) -> None:
    verdict = assemble_verdict("g", state, members)
    assert (verdict.status, verdict.reason_code) == (status, code)
    if code:
        assert reasons.get(code).status == status


def test_a_failed_member_rejects_with_its_code_and_detail() -> None:
    bad = SessionResult.failure(
        code="judge_failed",
        detail="all 3 votes failed; last error: connection refused",
        session_id="b",
        trajectory_id="b",
    )
    verdict = assemble_verdict("g", GroupState(decision="failed", group_size=2), [_member("a"), bad])
    assert (verdict.status, verdict.reason_code) == ("rejected", "judge_failed")
    assert verdict.reason == (
        "judge_failed: member 'b' (session 'b'): all 3 votes failed; last error: connection refused"
    )
    small = too_large_verdict(verdict, size=10_000, limit=1_000)
    assert small.reason_code == "verdict_too_large" and "it was rejected (judge_failed)" in small.reason


def test_a_discard_keeps_its_text_out_of_the_code() -> None:
    verdict = assemble_verdict(
        "g", GroupState(decision="discard", discard_reason="environment crashed before turn 3"), [_member("a")]
    )
    assert (verdict.reason_code, verdict.reason) == ("discarded", "environment crashed before turn 3")


@pytest.mark.parametrize(
    "state",
    [
        GroupState(decision="discard", discard_reason="crashed\n2030-01-01 00:00:00,000 ERROR forged\x1b[31m\u202e"),
        GroupState(
            decision="invalid",
            discard_reason="invalid_member: record t:0@5 was dead-lettered (InvalidMessage: "
            "Invalid value 'x\n2030-01-01 00:00:00,000 ERROR forged\x1b[31m\u202e')",
        ),
        GroupState(decision="failed", group_size=1),
    ],
)
def test_a_reason_quotes_the_records_text_escaped(state) -> None:
    bad = SessionResult.failure(
        code="scorer_error",
        detail="bad\n2030-01-01 00:00:00,000 ERROR forged\x1b[31m\u202e",
        session_id="b",
        trajectory_id="b",
    )
    verdict = assemble_verdict("g", state, [bad])
    assert verdict.reason.splitlines() == [verdict.reason]
    assert "\\n2030-01-01 00:00:00,000 ERROR forged\\x1b[31m\\u202e" in verdict.reason, verdict.reason


# --------------------------------------------------------------------------- member failures
def _traj(
    output: list[int], *, token_rewards: bytes | None = None, parent_input: list[int] | None = None
) -> ReadyTrajectory:
    turns = [
        Interaction(
            interaction_id="a",
            model_response=ModelResponse.from_arrays([1, 2], output),
            token_rewards_raw=token_rewards,
        )
    ]
    if parent_input is not None:
        turns.append(
            Interaction(interaction_id="b", parent_id="a", model_response=ModelResponse.from_arrays(parent_input, [9]))
        )
    return ReadyTrajectory(
        trajectory_id="t", session_id="s", group_id="g", group_size=1, interactions=turns, outcome_reward=1.0
    )


async def test_every_failure_path_sets_a_registered_error_code() -> None:
    runner = await PRMRunner.create(PRMConfig(scorers=[LengthBudgetScorer()]))  # type: ignore[list-item]
    try:
        failures = [
            await score_member(runner, _traj([3], parent_input=[7, 7]), timeout_s=None),  # not concat export
            await score_member(runner, _traj([]), timeout_s=None),  # no output tokens: invalid_reward
        ]
    finally:
        await runner.aclose()
    failures.append(unavailable(_member("t"), "prm.trajectories", 0, 5))
    assert [f.error_code for f in failures] == ["not_concat_export", "invalid_reward", "tokens_unavailable"]
    for f in failures:
        assert f.status == "failed" and reasons.is_member_code(f.failure_code) and f.error_detail
        assert f.error == f"{f.error_code}: {f.error_detail}"


def test_a_scorer_declares_only_registered_codes() -> None:
    class PluginFailed(RuntimeError):
        reason = "test_plugin_failed"

    class Undeclared(RuntimeError):
        reason = "made_up_code"

    reasons.register("test_plugin_failed", "a test scorer's own failure")
    assert failure_code(PluginFailed("x")) == "test_plugin_failed"
    assert failure_code(Undeclared("x")) == "scorer_error"
    assert "'made_up_code' is not a registered member code" in failure_detail(Undeclared("x"))

    class GroupCode(RuntimeError):
        reason = "missing_sessions"  # registered, but a group decision: never a member's code

    assert failure_code(GroupCode("x")) == "scorer_error"


# --------------------------------------------------------------------------- nothing parses the text
_SPLIT = re.compile(r"""(reason|error)\b[^\n]*\.split\(\s*["']:""")


def test_no_production_code_splits_code_and_detail() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for pkg in PRODUCTION
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _SPLIT.search(line)
    ]
    assert found == [], f"parse the typed reason_code / error_code instead: {found}"


def test_old_verdicts_without_reason_code_still_decode() -> None:
    from infra.schema import GroupVerdict, decode_verdict, encode

    headers = encode(GroupVerdict(group_id="g", status="accepted"))[1]
    old = msgspec.msgpack.encode(
        {
            "group_id": "g",
            "status": "discarded",
            "reason": "operator asked",
            "sessions": [{"session_id": "s", "trajectory_id": "t", "status": "discarded"}],
        }
    )
    verdict = decode_verdict(old, headers)
    assert verdict.reason_code == "" and reasons.metric_label(verdict.status, verdict.reason_code) == "unspecified"
