"""OpenClawJudgeScorer and OPDTeacherScorer against the real fake judge over HTTP."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch

from infra.schema import Interaction, ModelResponse, ReadyTrajectory
from prm_pipeline.demo.fake_judge import (
    FakeJudgeServer,
    fake_teacher_logprob,
    fake_tokenize,
)
from scoring_workers.judge.errors import JudgeFailedError
from scoring_workers.judge.limits import registered_limits
from scoring_workers.prm import PRMRunner, failure_code
from scoring_workers.scorers.conversation import render_chatml
from scoring_workers.scorers.opd import MissingLogprobsError, OPDTeacherScorer
from scoring_workers.scorers.openclaw import JudgeScorerResult, OpenClawJudgeScorer

OPENCLAW = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"
OPD = "scoring_workers.scorers.opd.OPDTeacherScorer"
MARGIN_S = 0.5

AUDIT_RECORDS: list[dict] = []


def record_audit(record: dict) -> None:
    AUDIT_RECORDS.append(record)


def char_tokenizer(messages) -> list[int]:
    """A pluggable tokenizer (by import path): the fake server's one-id-per-character scheme."""
    return fake_tokenize(render_chatml(messages))


@pytest.fixture
def server():
    srv = FakeJudgeServer()
    srv.start()
    yield srv
    srv.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- fixtures
SYS = {"role": "system", "content": "You are a shell assistant."}
U1 = {"role": "user", "content": "What is in /root?"}
A0 = {
    "role": "assistant",
    "content": "Let me look.",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/root"}'}}],
}
T0 = {"role": "tool", "content": "Error: permission denied", "tool_call_id": "c1"}
A1 = {"role": "assistant", "content": "I cannot read /root without sudo; here is /tmp instead: a.txt"}
U2 = {"role": "user", "content": "thanks, that works"}
A2 = {"role": "assistant", "content": "You're welcome."}


def _response(n: int, *, logprobs: bool = True) -> ModelResponse:
    out = np.arange(70, 70 + n, dtype=np.int32)
    lps = -np.linspace(0.1, 1.0, n, dtype=np.float32) if logprobs else None
    return ModelResponse.from_arrays(np.arange(5, dtype=np.int32), out, lps)


def three_turns(*, u2: str = U2["content"], t0: str = T0["content"], logprobs: bool = True) -> list[Interaction]:
    t0_msg = {**T0, "content": t0}
    u2_msg = {**U2, "content": u2}
    return [
        Interaction(
            interaction_id="t0",
            messages=[SYS, U1],
            output_message_list=[A0],
            model_response=_response(3, logprobs=logprobs),
        ),
        Interaction(
            interaction_id="t1",
            parent_id="t0",
            messages=[SYS, U1, A0, t0_msg],
            output_message_list=[A1],
            model_response=_response(4, logprobs=logprobs),
        ),
        Interaction(
            interaction_id="t2",
            parent_id="t1",
            messages=[SYS, U1, A0, t0_msg, A1, u2_msg],
            output_message_list=[A2],
            model_response=_response(2, logprobs=logprobs),
        ),
    ]


def trajectory(interactions: list[Interaction]) -> ReadyTrajectory:
    return ReadyTrajectory(
        trajectory_id="traj-1",
        session_id="s-1",
        group_id="g-1",
        group_size=1,
        interactions=interactions,
        outcome_reward=1.0,
    )


def ctx_for(interactions: list[Interaction]) -> dict:
    leaf = interactions[-1]
    return {
        "messages": tuple(leaf.messages) + tuple(leaf.output_message_list),
        "trajectory_id": "traj-1",
        "leaf_id": leaf.interaction_id,
    }


def obs(result, metric):
    return {o.metric_id: o.value for o in result.observations}[metric]


def judge_kwargs(url: str, **extra) -> dict:
    kwargs = {"base_url": url, "model": "fake", "max_retries": 0, "backoff_base_s": 0.001, "backoff_max_s": 0.01}
    kwargs.update(extra)
    return kwargs


# --------------------------------------------------------------------------- OpenClaw
async def test_openclaw_scores_a_three_turn_conversation_through_the_runner(server):
    runner = await PRMRunner.create({"scorers": [{"path": OPENCLAW, "kwargs": judge_kwargs(server.base_url)}]})
    try:
        scored = await runner.run(trajectory(three_turns()))
    finally:
        await runner.aclose()
    branch = scored.branches[0]
    # t0's tool returned an error -> -1; t1 was followed by "thanks" -> +1; t2 has no next state -> 0.
    assert {iid: t.tolist() for iid, t in branch.token_rewards.items()} == {
        "t0": [-1.0] * 3,
        "t1": [1.0] * 4,
        "t2": [0.0] * 2,
    }
    has_next = {r.interaction_id: obs(r, "has_next_state") for r in branch.turn_results}
    assert has_next == {"t0": True, "t1": True, "t2": False}
    stats = scored.stats()
    base = "rollout/prm_metric/turn/openclaw_judge"
    assert stats[f"{base}/judge_calls/sum"] == 4.0  # two agreeing votes per judged turn
    assert stats[f"{base}/judge_calls_saved/sum"] == 2.0
    assert stats[f"{base}/judge_failed/count"] == 0.0
    assert stats[f"{base}/has_next_state/count"] == 2.0 and stats[f"{base}/has_next_state/rate"] == pytest.approx(2 / 3)
    assert server.by_path["/v1/chat/completions"] == 4
    assert registered_limits(server.base_url) is None  # the runner closed the scorer and its client


async def test_openclaw_fixed_voting_and_sglang_api(server):
    turns = three_turns()
    ctx = ctx_for(turns)
    fixed = OpenClawJudgeScorer(**judge_kwargs(server.base_url, adaptive=False))
    sglang = OpenClawJudgeScorer(**judge_kwargs(server.base_url, api="sglang"))
    try:
        assert [await fixed.evaluate(t, ctx) for t in turns] == [-1.0, 1.0, 0.0]
        assert server.by_path["/v1/chat/completions"] == 6  # m = 3 per judged turn
        assert [await sglang.evaluate(t, ctx) for t in turns] == [-1.0, 1.0, 0.0]
        assert server.by_path["/generate"] == 4
    finally:
        await fixed.aclose()
        await sglang.aclose()


@pytest.mark.parametrize(
    ("votes", "score", "calls", "errors", "invalid"),
    [
        ("1, 1, -1", 1.0, 2, 0, 0),
        ("-1, -1, 1", -1.0, 2, 0, 0),
        ("1, -1, 1", 1.0, 3, 0, 0),
        ("1, -1, 0", 0.0, 3, 0, 0),
        ("500, 1, 1", 1.0, 3, 1, 0),
        ("x, -1, -1", -1.0, 3, 0, 1),
        ("500, 500, 1", 1.0, 3, 2, 0),
    ],
)
async def test_openclaw_scripted_votes(server, votes, score, calls, errors, invalid):
    turns = three_turns(u2=f"hmm [[votes: {votes}]]")
    scorer = OpenClawJudgeScorer(**judge_kwargs(server.base_url))
    try:
        result = await scorer.evaluate_result(turns[1], ctx_for(turns))
    finally:
        await scorer.aclose()
    assert isinstance(result, JudgeScorerResult) and result.reward == score
    assert obs(result, "judge_calls") == calls and obs(result, "judge_calls_saved") == 3 - calls
    assert obs(result, "judge_call_errors") == errors and obs(result, "judge_votes_invalid") == invalid
    assert obs(result, "judge_failed") is False


async def test_escalation_breaks_a_three_way_split(server):
    turns = three_turns(u2="[[votes: 1, -1, 0, -1]]")
    scorer = OpenClawJudgeScorer(**judge_kwargs(server.base_url, max_votes=5))
    try:
        result = await scorer.evaluate_result(turns[1], ctx_for(turns))
    finally:
        await scorer.aclose()
    assert result.reward == -1.0 and obs(result, "judge_calls") == 4 and obs(result, "judge_calls_saved") == 0


@pytest.mark.parametrize("votes", ["500", "x", "500, x, 503"])
async def test_all_votes_failed_rejects_with_reason_judge_failed(server, votes):
    turns = three_turns(u2=f"[[votes: {votes}]]")
    scorer = OpenClawJudgeScorer(**judge_kwargs(server.base_url))
    try:
        with pytest.raises(JudgeFailedError) as info:
            await scorer.evaluate_result(turns[1], ctx_for(turns))
    finally:
        await scorer.aclose()
    assert info.value.reason == "judge_failed" and info.value.interaction_id == "t1" and info.value.calls == 3
    assert scorer.counters["judge_failed"] == 1 and scorer.counters["rejected"] == 1


async def test_all_votes_failed_rejects_the_trajectory_through_the_runner(server):
    runner = await PRMRunner.create({"scorers": [{"path": OPENCLAW, "kwargs": judge_kwargs(server.base_url)}]})
    try:
        with pytest.raises(JudgeFailedError) as info:  # the scorer's own exception propagates (AReaL)
            await runner.run(trajectory(three_turns(u2="[[votes: 500]]")))
    finally:
        await runner.aclose()
    assert info.value.reason == "judge_failed" and failure_code(info.value) == "judge_failed"


async def test_all_votes_failed_neutral_is_a_counted_zero(server):
    turns = three_turns(u2="[[votes: 500]]")
    runner = await PRMRunner.create(
        {"scorers": [{"path": OPENCLAW, "kwargs": judge_kwargs(server.base_url, on_all_votes_failed="neutral")}]}
    )
    try:
        scored = await runner.run(trajectory(turns))
    finally:
        await runner.aclose()
    assert scored.branches[0].token_rewards["t1"].tolist() == [0.0] * 4
    stats = scored.stats()
    assert stats["rollout/prm_metric/turn/openclaw_judge/judge_failed/count"] == 1.0
    assert stats["rollout/prm_metric/turn/openclaw_judge/judge_call_errors/sum"] == 3.0


async def test_open_breaker_fails_every_vote_fast(server):
    turns = three_turns()
    scorer = OpenClawJudgeScorer(**judge_kwargs(server.base_url, breaker_failure_threshold=1, breaker_reset_s=600))
    server.set_outage(True)
    try:
        with pytest.raises(JudgeFailedError, match="circuit"):
            await scorer.evaluate_result(turns[0], ctx_for(turns))
        assert server.requests <= 2  # the first batch's failures opened the breaker
        seen = server.requests
        with pytest.raises(JudgeFailedError):
            await scorer.evaluate_result(turns[1], ctx_for(turns))
        assert server.requests == seen  # nothing sent while open
    finally:
        await scorer.aclose()


async def test_turn_timeout_bounds_all_votes_of_a_turn():
    with FakeJudgeServer(hang_s=5) as srv:
        turns = three_turns(u2="[[votes: hang]]")
        scorer = OpenClawJudgeScorer(**judge_kwargs(srv.base_url, turn_timeout_s=0.3))
        try:
            start = time.monotonic()
            with pytest.raises(JudgeFailedError, match="timeout"):
                await scorer.evaluate_result(turns[1], ctx_for(turns))
            assert time.monotonic() - start < 0.3 + MARGIN_S
        finally:
            await scorer.aclose()


async def test_audit_texts_and_sink(server):
    AUDIT_RECORDS.clear()
    turns = three_turns(u2="[[votes: 1, -1, 1]]")
    scorer = OpenClawJudgeScorer(**judge_kwargs(server.base_url, audit_sink=f"{__name__}:record_audit"))
    try:
        result = await scorer.evaluate_result(turns[1], ctx_for(turns))
    finally:
        await scorer.aclose()
    audit = dict(result.audit)
    assert audit["score"] == "1.0" and audit["next_state_role"] == "user"
    assert sorted(audit["votes"].split(",")) == ["-1", "1", "1"]
    deciding = {k: v for k, v in audit.items() if k.startswith("vote_")}
    assert len(deciding) == 2 and all(v.endswith("\\boxed{1}") for v in deciding.values())
    assert AUDIT_RECORDS == [
        {
            "scorer": "openclaw_judge",
            "version": "1",
            "trajectory_id": "traj-1",
            "leaf_id": "t2",
            "interaction_id": "t1",
            **audit,
        }
    ]


async def test_merge_tool_results(server):
    tool_ok = {"role": "tool", "content": "first call: success", "tool_call_id": "a"}
    tool_err = {"role": "tool", "content": "second call: Error", "tool_call_id": "b"}
    turn = Interaction(interaction_id="t0", messages=[U1], output_message_list=[A0], model_response=_response(2))
    ctx = {"messages": (U1, A0, tool_ok, tool_err, A2)}
    upstream = OpenClawJudgeScorer(**judge_kwargs(server.base_url))
    plain = OpenClawJudgeScorer(**judge_kwargs(server.base_url, next_state="first"))
    merged = OpenClawJudgeScorer(**judge_kwargs(server.base_url, next_state="first", merge_tool_results=True))
    try:
        assert await upstream.evaluate(turn, ctx) == -1.0  # OpenClaw-RL: the last tool message, "Error"
        assert await plain.evaluate(turn, ctx) == 1.0  # only the first tool message: "success"
        assert await merged.evaluate(turn, ctx) == -1.0  # both: the error counts
        with pytest.raises(ValueError, match="merge_tool_results applies to next_state 'first'"):
            OpenClawJudgeScorer(**judge_kwargs(server.base_url, merge_tool_results=True))
    finally:
        await upstream.aclose()
        await plain.aclose()
        await merged.aclose()


async def test_unlocated_output_and_missing_ctx(server):
    scorer = OpenClawJudgeScorer(**judge_kwargs(server.base_url))
    turn = Interaction(
        interaction_id="x",
        messages=[U1],
        output_message_list=[{"role": "assistant", "content": "?"}],
        model_response=_response(1),
    )
    try:
        result = await scorer.evaluate_result(turn, {"messages": (SYS, U2, A2, U2)})
        assert (
            result.reward == 0.0 and obs(result, "output_located") is False and obs(result, "has_next_state") is False
        )
        with pytest.raises(ValueError, match="ctx\\['messages'\\]"):
            await scorer.evaluate_result(turn, {})
    finally:
        await scorer.aclose()
    assert server.requests == 0


async def test_sampling_judges_are_not_deterministic(server):
    sampling = OpenClawJudgeScorer(base_url=server.base_url)  # temperature 0.6 (OpenClaw-RL default)
    greedy = OPDTeacherScorer(base_url=server.base_url, temperature=0.0)
    try:
        assert sampling.deterministic is False and greedy.deterministic is True
    finally:
        await sampling.aclose()
        await greedy.aclose()


def test_config_validation(server):
    url = server.base_url
    with pytest.raises(ValueError, match="api"):
        OpenClawJudgeScorer(base_url=url, api="grpc")
    with pytest.raises(ValueError, match="on_all_votes_failed"):
        OpenClawJudgeScorer(base_url=url, on_all_votes_failed="ignore")
    with pytest.raises(ValueError, match="scorer 'openclaw_judge': m: Expected `int` >= 1"):
        OpenClawJudgeScorer(base_url=url, m=0)
    with pytest.raises(ValueError, match="max_votes"):
        OpenClawJudgeScorer(base_url=url, max_votes=2)
    with pytest.raises(TypeError):
        OpenClawJudgeScorer(base_url=url, temprature=0.5)  # a typo fails at start-up
    with pytest.raises(TypeError):
        OpenClawJudgeScorer()  # base_url is required
    with pytest.raises(ImportError, match="chat_template"):
        OpenClawJudgeScorer(base_url=url, chat_template="no.such.module:fn")
    assert registered_limits(url) is None  # nothing leaked by the failed constructors


# --------------------------------------------------------------------------- OPD
async def test_opd_accepted_hint_gives_teacher_minus_rollout(server):
    turns = three_turns()
    scorer = OPDTeacherScorer(**judge_kwargs(server.base_url))
    try:
        result = await scorer.evaluate_result(turns[0], ctx_for(turns))  # next state: tool error -> hint
    finally:
        await scorer.aclose()
    out = turns[0].model_response.output_tokens
    rollout = turns[0].model_response.output_logprobs
    expected = torch.tensor([fake_teacher_logprob(t, hinted=True) for t in out]) - torch.from_numpy(rollout.copy())
    assert result.reward.dtype == torch.float32 and result.reward.shape == (3,)
    torch.testing.assert_close(result.reward, expected)
    assert obs(result, "hint_accepted") is True and obs(result, "has_next_state") is True
    assert obs(result, "judge_calls") == 3 and obs(result, "teacher_calls") == 1
    assert obs(result, "opd_signal_mean") == pytest.approx(float(expected.mean()))
    assert "permission denied" in result.audit["hint"]
    assert server.by_path["/tokenize"] == 1 and server.by_path["/generate"] == 1
    assert server.votes_served["hint"] == 3 and server.votes_served["teacher"] == 1


async def test_opd_pluggable_tokenizer_and_separate_teacher(server):
    turns = three_turns()
    with FakeJudgeServer() as teacher:
        scorer = OPDTeacherScorer(
            **judge_kwargs(server.base_url, teacher_base_url=teacher.base_url, tokenizer=f"{__name__}:char_tokenizer")
        )
        try:
            result = await scorer.evaluate_result(turns[0], ctx_for(turns))
        finally:
            await scorer.aclose()
        assert teacher.by_path == {"/generate": 1}  # no /tokenize call: tokenized locally
    assert server.by_path == {"/v1/chat/completions": 3}
    assert obs(result, "hint_accepted") is True and result.reward.shape == (3,)


async def test_opd_without_hint_or_next_state_is_zero(server):
    turns = three_turns()
    scorer = OPDTeacherScorer(**judge_kwargs(server.base_url))
    try:
        no_hint = await scorer.evaluate_result(turns[1], ctx_for(turns))  # "thanks" -> \boxed{-1}, no hint
        no_next = await scorer.evaluate_result(turns[2], ctx_for(turns))
    finally:
        await scorer.aclose()
    assert no_hint.reward.tolist() == [0.0] * 4 and obs(no_hint, "hint_accepted") is False
    assert obs(no_hint, "has_next_state") is True and obs(no_hint, "teacher_calls") == 0
    assert "opd_signal_mean" not in {o.metric_id for o in no_hint.observations}
    assert no_next.reward.tolist() == [0.0] * 2 and obs(no_next, "has_next_state") is False
    assert server.by_path["/v1/chat/completions"] == 3 and server.by_path["/generate"] == 0


async def test_opd_requires_rollout_logprobs(server):
    turns = three_turns(logprobs=False)
    scorer = OPDTeacherScorer(**judge_kwargs(server.base_url))
    try:
        with pytest.raises(MissingLogprobsError, match="output_logprobs"):
            await scorer.evaluate_result(turns[0], ctx_for(turns))
    finally:
        await scorer.aclose()
    assert server.requests == 0  # checked before any call


async def test_opd_teacher_failure_rejects_or_is_neutral(server):
    turns = three_turns()
    dead = f"http://127.0.0.1:{_free_port()}"
    reject = OPDTeacherScorer(**judge_kwargs(server.base_url, teacher_base_url=dead))
    neutral = OPDTeacherScorer(**judge_kwargs(server.base_url, teacher_base_url=dead, on_all_votes_failed="neutral"))
    try:
        with pytest.raises(JudgeFailedError) as info:
            await reject.evaluate_result(turns[0], ctx_for(turns))
        assert info.value.reason == "judge_failed"
        result = await neutral.evaluate_result(turns[0], ctx_for(turns))
        assert result.reward.tolist() == [0.0] * 3 and obs(result, "judge_failed") is True
        assert "teacher_error" in result.audit
    finally:
        await reject.aclose()
        await neutral.aclose()


async def test_opd_all_hint_votes_failed(server):
    turns = three_turns(t0="Error [[votes: 500]]")
    scorer = OPDTeacherScorer(**judge_kwargs(server.base_url))
    try:
        with pytest.raises(JudgeFailedError, match="hint-judge"):
            await scorer.evaluate_result(turns[0], ctx_for(turns))
    finally:
        await scorer.aclose()


async def test_judge_and_opd_together_in_one_runner(server):
    config = {
        "scorers": [
            {"path": OPENCLAW, "weight": 0.5, "kwargs": judge_kwargs(server.base_url)},
            {"path": OPD, "weight": 1.0, "kwargs": judge_kwargs(server.base_url)},
        ]
    }
    runner = await PRMRunner.create(config)
    try:
        scored = await runner.run(trajectory(three_turns()))
    finally:
        await runner.aclose()
    rewards = scored.branches[0].token_rewards
    t0 = three_turns()[0].model_response
    opd = np.array([fake_teacher_logprob(t, True) for t in t0.output_tokens], dtype=np.float32) - t0.output_logprobs
    np.testing.assert_allclose(rewards["t0"].numpy(), 0.5 * -1.0 + opd, rtol=1e-6)
    assert rewards["t1"].tolist() == [0.5] * 4 and rewards["t2"].tolist() == [0.0] * 2
    assert registered_limits(server.base_url) is None


async def test_a_judge_outage_names_its_cause_in_the_members_failure_and_the_verdict():
    """With the breaker open, the rejection still says why: the last underlying error."""
    import msgspec

    from scoring_workers.ledger import GroupState
    from scoring_workers.scoring import score_member
    from scoring_workers.verdicts import assemble_verdict

    turns, prefix = [], np.arange(5, dtype=np.int32)  # three_turns, laid out as concat export
    for it in three_turns():
        out = it.model_response.output_tokens
        turns.append(msgspec.structs.replace(it, model_response=ModelResponse.from_arrays(prefix, out)))
        prefix = np.concatenate([prefix, out, [9]]).astype(np.int32)
    url = f"http://127.0.0.1:{_free_port()}"
    runner = await PRMRunner.create(
        {"scorers": [{"path": OPENCLAW, "kwargs": judge_kwargs(url, breaker_failure_threshold=1, breaker_reset_s=300)}]}
    )
    try:
        opened = await score_member(runner, trajectory(turns), timeout_s=30)  # connect errors open it
        failed = await score_member(runner, trajectory(turns), timeout_s=30)  # refused: circuit open
    finally:
        await runner.aclose()
    assert opened.error_code == failed.error_code == "judge_failed"
    assert "circuit_open" in failed.error_detail and "circuit breaker open" in failed.error_detail
    assert "cannot connect" in failed.error_detail, failed.error_detail
    verdict = assemble_verdict("g-1", GroupState(decision="failed", group_size=1), [failed])
    assert verdict.reason_code == "judge_failed" and "cannot connect" in verdict.reason, verdict.reason


async def test_opd_streams_on_the_next_state_alone(server):
    """The OPD teacher's stream key is the next state: the conversation up to it (a streamed
    turn's ctx) gives the whole branch's key and result; another next state gives neither."""
    turns = three_turns()
    streamed_ctx = {**ctx_for(turns), "messages": (*turns[1].messages, *turns[1].output_message_list)}
    rewritten = three_turns(t0="ok, listed")
    scorer = OPDTeacherScorer(**judge_kwargs(server.base_url))
    try:
        key, ready_key = scorer.stream_key(turns[0], streamed_ctx), scorer.stream_key(turns[0], ctx_for(turns))
        other_key = scorer.stream_key(turns[0], ctx_for(rewritten))
        streamed = await scorer.evaluate_result(turns[0], streamed_ctx)
        ready = await scorer.evaluate_result(turns[0], ctx_for(turns))
        other = await scorer.evaluate_result(turns[0], ctx_for(rewritten))
    finally:
        await scorer.aclose()
    assert OPDTeacherScorer.streamable
    assert key == ready_key and torch.equal(streamed.reward, ready.reward)
    assert other_key != key and not torch.equal(other.reward, ready.reward)
