"""Turn results computed before a session ends (:mod:`scoring_workers.prm.streamed`,
:meth:`PRMRunner.score_turn`) and reused at its end give the ``ready`` form's results,
bit for bit, and call the scorers only for what is left."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np
import pytest

from infra.schema import ReadyTrajectory, expand_trajectory
from prm_pipeline.demo.synthetic import make_session
from scoring_workers.prm import BaseScorer, PRMConfig, PRMRunner, PRMScorerResult
from scoring_workers.prm.streamed import Reuse, decode_results, encode_results
from scoring_workers.scorers import LengthBudgetScorer


def _next_message(interaction: Any, ctx: dict[str, Any]) -> str | None:
    at = len(interaction.messages) + len(interaction.output_message_list)
    conversation = ctx["messages"]
    return str(conversation[at].get("content")) if at < len(conversation) else None


def _unit(*parts: Any) -> float:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class NextStateJudge(BaseScorer):
    """Stands for a judge: a score from the turn's output and the message after it."""

    name = "next_state_judge"
    streamable = True
    calls = 0

    def stream_key(self, interaction: Any, ctx: dict[str, Any]) -> object:
        return _next_message(interaction, ctx)

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        type(self).calls += 1
        nxt = _next_message(interaction, ctx)
        return 0.0 if nxt is None else float(np.sign(_unit(interaction.model_response.output_tokens_raw, nxt) - 0.5))


class DenseTeacher(BaseScorer):
    """Stands for a teacher: a float64 array per output token (exercises the float32 path)."""

    name = "dense_teacher"
    streamable = True
    calls = 0

    def stream_key(self, interaction: Any, ctx: dict[str, Any]) -> object:
        return _next_message(interaction, ctx)

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> Any:
        type(self).calls += 1
        seed = int(_unit(interaction.interaction_id, _next_message(interaction, ctx)) * 2**32)
        return np.random.default_rng(seed).normal(size=interaction.model_response.output_len)


class WholeBranch(BaseScorer):
    """Not streamable: reads the whole branch (its length), so it runs at the end."""

    name = "whole_branch"

    async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
        return len(ctx["messages"]) / 100


def runner() -> PRMRunner:
    return PRMRunner(
        PRMConfig(
            enabled=True,
            scorers=[
                NextStateJudge(weight=0.7),
                DenseTeacher(weight=0.3),
                LengthBudgetScorer(max_output_tokens=20),
                WholeBranch(),
            ],
        )
    )


async def streamed_results(r: PRMRunner, traj: ReadyTrajectory) -> list[Any]:
    """What a worker parks while the session streams: every turn scored when a child arrives,
    through the ledger's encoding."""
    by_id = {i.interaction_id: i for i in traj.interactions}
    out = []
    for child in traj.interactions:
        if child.parent_id is not None:
            out += await r.score_turn(
                by_id[child.parent_id], child, {"session_id": traj.session_id, "trajectory_id": traj.trajectory_id}
            )
    return decode_results(encode_results(out))


def verdict_bytes(scored: Any) -> list[bytes]:
    return [msgspec.msgpack.encode(b.to_branch_result()) for b in scored.branches] + [
        msgspec.msgpack.encode(b.turn_results) for b in scored.branches
    ]


@pytest.mark.parametrize("seed", range(12))
async def test_streamed_then_reused_is_the_ready_result_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    turns = int(rng.integers(1, 16))
    branch_at = int(rng.integers(0, turns - 1)) if turns > 2 and seed % 2 else None
    traj = make_session(
        trajectory_id="t",
        session_id="s",
        group_id="g",
        group_size=1,
        turns=turns,
        output_tokens=(1, 30),
        branch_at=branch_at,
        rng=rng,
    )
    r = runner()
    ready = await r.run(traj)
    results = await streamed_results(r, traj)
    NextStateJudge.calls = DenseTeacher.calls = 0
    reuse = Reuse(results)
    streamed = await r.run(traj, reuse=reuse)
    assert verdict_bytes(streamed) == verdict_bytes(ready)
    assert streamed.stats() == ready.stats()
    leaves = {i.interaction_id for i in traj.interactions} - {i.parent_id for i in traj.interactions}
    path_turns = sum(len(b.path) for b in ready.branches)
    # only the leaves are judged at the end (no child brought their next state)
    assert NextStateJudge.calls == DenseTeacher.calls == len(leaves)
    assert reuse.hits == 3 * (path_turns - len(leaves))


async def test_a_rewritten_history_is_scored_again_at_the_end() -> None:
    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=4)
    r = runner()
    results = await streamed_results(r, traj)
    # the last turn rewrote the reply to turn 1: the branch's conversation no longer says what was judged
    last = traj.interactions[-1]
    messages = [dict(m) for m in last.messages]
    messages[4] = {**messages[4], "content": "rewritten"}
    edited = msgspec.structs.replace(
        traj, interactions=[*traj.interactions[:-1], msgspec.structs.replace(last, messages=messages)]
    )
    reuse = Reuse(results)
    assert verdict_bytes(await r.run(edited, reuse=reuse)) == verdict_bytes(await r.run(edited))
    assert reuse.misses >= 2  # turn 1, for both streamable scorers


async def test_failures_while_streaming_are_left_for_the_end() -> None:
    class Flaky(BaseScorer):
        name = "flaky"
        streamable = True

        async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> Any:
            raise RuntimeError("judge down")

    class Undecided(BaseScorer):
        name = "undecided"
        streamable = True

        async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> Any:
            return None

    traj = make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=2)
    r = PRMRunner(PRMConfig(enabled=True, scorers=[Flaky(), Undecided(), LengthBudgetScorer()]))
    results = await r.score_turn(traj.interactions[0], traj.interactions[1], {"session_id": "s"})
    assert [x.name for x in results] == ["length_budget"]


async def test_only_streamable_turn_scorers_run_and_see_the_conversation_up_to_the_next_state() -> None:
    seen: list[dict[str, Any]] = []

    class Spy(BaseScorer):
        name = "spy"
        streamable = True

        async def evaluate(self, interaction: Any, ctx: dict[str, Any]) -> float:
            seen.append(ctx)
            return 1.0

    traj = expand_trajectory(make_session(trajectory_id="t", session_id="s", group_id="g", group_size=1, turns=3))
    r = PRMRunner(PRMConfig(enabled=True, scorers=[WholeBranch(), Spy()]))
    assert r.streams
    (result,) = await r.score_turn(
        traj.interactions[0], traj.interactions[1], {"session_id": "s", "trajectory_id": "t", "is_eval": True}
    )
    assert (result.scorer, result.name, result.interaction_id) == (1, "spy", traj.interactions[0].interaction_id)
    (ctx,) = seen
    child = traj.interactions[1]
    assert list(ctx["messages"]) == child.messages + child.output_message_list
    assert ctx["leaf_id"] == child.interaction_id and "is_eval" not in ctx
    assert not PRMRunner(PRMConfig(enabled=True, scorers=[WholeBranch()])).streams


def test_a_stored_result_reads_back_as_the_runner_reads_the_original() -> None:
    from scoring_workers.prm.streamed import StreamedResult

    dense = np.array([0.1, 1e-8, -3.3333333333], dtype=np.float64)
    back = StreamedResult.of(0, "x", "i", b"", PRMScorerResult(dense)).result().reward
    assert back.dtype == np.float32 and back.tobytes() == dense.astype(np.float32).tobytes()
    assert StreamedResult.of(0, "x", "i", b"", PRMScorerResult(np.float32(0.1))).result().reward == float(
        np.float32(0.1)
    )
    assert StreamedResult.of(0, "x", "i", b"", PRMScorerResult(True)).result().reward == 1.0
