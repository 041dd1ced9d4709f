"""Regenerate the golden wire vectors in this folder: ``python tests/vectors/generate.py``.

Each vector is one Kafka record as the pipeline puts it on the wire: ``NAME.msgpack``
holds the record value byte for byte, ``NAME.json`` is its readable twin (topic, key,
headers, and the msgpack map with every packed array shown as its numbers). The
messages are built from the wire structs of :mod:`infra.schema` with fixed values (no
clocks, no randomness), so running this twice writes the same files.

These files are the contract of docs/wire.md: ``tests/unit/test_wire_vectors.py``
decodes every one and re-encodes it byte for byte. When a schema change adds an
OPTIONAL field, run this script and commit the result; if an existing ``.msgpack``
changes although no field was added, that change is a wire break.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":  # run as a script from any directory
    sys.path.insert(0, str(HERE.parents[1]))

from infra.schema import (  # noqa: E402
    BranchResult,
    DiscardGroup,
    GroupVerdict,
    Interaction,
    ModelResponse,
    PRMMetricObservation,
    PRMTurnResult,
    ReadyTrajectory,
    ScorerInfo,
    SessionEnd,
    SessionResult,
    SessionTurn,
    TokenRef,
    TokenRewards,
    TrajectoryChunk,
    compact_trajectory,
    compact_turns,
    encode,
    stream_session,
)
from infra.turns import TurnCompactor  # noqa: E402

# Wire keys whose msgpack ``bin`` value is a packed little-endian array, and its dtype.
PACKED_KEYS: dict[str, str] = {
    "input_tokens": "<i4",
    "output_tokens": "<i4",
    "prompt_delta": "<i4",
    "output_logprobs": "<f4",
    "values": "<f4",
}
TOPICS = {
    "ready": "prm.trajectories",
    "discard": "prm.trajectories",
    "chunk": "prm.trajectories",
    "turn": "prm.trajectories",
    "end": "prm.trajectories",
    "verdict": "prm.verdicts",
}
BYTES_KEYS = {"data"}  # msgpack ``bin`` that is not an array: a chunk's slice of a record value
T0 = 1_764_500_000.0  # a fixed "now" (unix seconds): vectors never depend on the clock


# --------------------------------------------------------------------------- messages
def _turn(
    iid: str,
    parent: str | None,
    inputs: list[int],
    outputs: list[int],
    logprobs: list[float],
    content: str,
    stop: str = "stop",
) -> Interaction:
    return Interaction(
        interaction_id=iid,
        parent_id=parent,
        messages=[{"role": "user", "content": content}],
        output_message_list=[{"role": "assistant", "content": f"answer to {content}"}],
        model_response=ModelResponse.from_arrays(inputs, outputs, logprobs, stop),
    )


def ready_single_turn() -> ReadyTrajectory:
    return ReadyTrajectory(
        trajectory_id="g-vec-1/t0",
        session_id="g-vec-1/s0",
        group_id="g-vec-1",
        group_size=2,
        interactions=[_turn("i0", None, [101, 102, 103], [7, 8, 9, 2], [-0.5, -0.25, -0.125, -1.0], "2+2?")],
        outcome_reward=1.0,
        policy_version=3,
        created_at=T0,
    )


def ready_experiment() -> ReadyTrajectory:
    """``ready_single_turn`` for experiment ``exp-a`` (the default experiment's records leave the field out)."""
    return msgspec.structs.replace(ready_single_turn(), experiment_id="exp-a")


def ready_branching() -> ReadyTrajectory:
    """Root -> child -> two leaves (concat export: each input = parent input + output + delta)."""
    root_in, root_out = [101, 102], [11, 12, 13]
    child_in = root_in + root_out + [201]
    child_out = [21, 22]
    leaf_in = child_in + child_out + [301, 302]
    return ReadyTrajectory(
        trajectory_id="g-vec-2/t1",
        session_id="g-vec-2/s1",
        group_id="g-vec-2",
        group_size=1,
        interactions=[
            _turn("root", None, root_in, root_out, [-0.5, -0.5, -0.25], "plan"),
            _turn("step", "root", child_in, child_out, [-0.125, -0.0625], "tool said 4"),
            _turn("leaf-a", "step", leaf_in, [31, 32, 33, 2], [-0.25, -0.5, -0.75, -1.0], "finish"),
            _turn("leaf-b", "step", leaf_in, [41, 42], [-2.0, -4.0], "retry", stop="length"),
        ],
        outcome_reward=0.0,
        is_eval=False,
        policy_version=None,
        created_at=T0 + 1,
    )


def ready_compact_full() -> ReadyTrajectory:
    """An agent session in the full form: the twin ``ready_compact`` expands to (not a vector itself).

    root -> step -> leaf-a (concat export: shares the whole context) and
    root -> step -> leaf-b (history re-rendered: shares the step's prompt and the first
    two messages only, the assistant message was rewritten).
    """
    root_in, root_out = [101, 102], [11, 12, 13]
    step_in, step_out = root_in + root_out + [201], [21, 22]
    system = {"role": "system", "content": "You are a coding agent."}
    task = {"role": "user", "content": "fix the test"}
    root_ans = {"role": "assistant", "content": "run pytest"}
    tool = {"role": "tool", "content": "1 failed"}
    step_ans = {"role": "assistant", "content": "<think>x</think>edit a.py"}

    def turn(
        iid: str,
        parent: str | None,
        msgs: list[dict],
        answer: dict,
        inputs: list[int],
        outputs: list[int],
        logprobs: list[float],
    ) -> Interaction:
        return Interaction(
            interaction_id=iid,
            parent_id=parent,
            messages=msgs,
            output_message_list=[answer],
            model_response=ModelResponse.from_arrays(inputs, outputs, logprobs, "stop"),
        )

    return ReadyTrajectory(
        trajectory_id="g-vec-4/t0",
        session_id="g-vec-4/s0",
        group_id="g-vec-4",
        group_size=1,
        interactions=[
            turn("root", None, [system, task], root_ans, root_in, root_out, [-0.5, -0.5, -0.25]),
            turn("step", "root", [system, task, root_ans, tool], step_ans, step_in, step_out, [-0.125, -0.0625]),
            turn(
                "leaf-a",
                "step",
                [system, task, root_ans, tool, step_ans, {"role": "tool", "content": "passed"}],
                {"role": "assistant", "content": "done"},
                step_in + step_out + [301],
                [31, 2],
                [-0.25, -1.0],
            ),
            turn(
                "leaf-b",
                "step",
                [system, task, {"role": "assistant", "content": "edit a.py"}, {"role": "tool", "content": "passed"}],
                {"role": "assistant", "content": "done"},
                step_in + [22, 302],
                [41, 2],
                [-2.0, -1.0],
            ),
        ],
        outcome_reward=1.0,
        policy_version=5,
        created_at=T0 + 4,
    )


def ready_compact() -> ReadyTrajectory:
    """``ready_compact_full`` in the compact form (schema version 2)."""
    return compact_trajectory(ready_compact_full())


def _chunk(index: int) -> TrajectoryChunk:
    value, _ = encode(ready_compact())
    half = (len(value) + 1) // 2
    return TrajectoryChunk(
        group_id="g-vec-4",
        trajectory_id="g-vec-4/t0",
        index=index,
        count=2,
        total_bytes=len(value),
        data=value[index * half : (index + 1) * half],
    )  # type: ignore[arg-type]


def chunk_0() -> TrajectoryChunk:
    """The first of two chunks carrying ``ready_compact`` (a record too large for one message)."""
    return _chunk(0)


def chunk_1() -> TrajectoryChunk:
    return _chunk(1)


def _streamed() -> tuple[list[SessionTurn], SessionEnd]:
    """``ready_compact_full`` as a streamed session, each turn compacted against its parent."""
    turns, end = stream_session(ready_compact_full())
    compactor = TurnCompactor()
    return [compactor.compact(t) for t in turns], end


def turn_root() -> SessionTurn:
    """The first turn of the streamed twin of ``ready_compact_full`` (a root: full form, version 1)."""
    return _streamed()[0][0]


def turn_compact() -> SessionTurn:
    """Its turn ``leaf-a``: shares the whole context of its parent ``step`` (version 2)."""
    return _streamed()[0][2]


def end_session() -> SessionEnd:
    """The end of that streamed session (after its four turns)."""
    return _streamed()[1]


def discard() -> DiscardGroup:
    return DiscardGroup(group_id="g-vec-3", reason="prompt filtered by the proxy", requested_at=T0 + 2)


_SCORERS = [ScorerInfo("length_budget", "1"), ScorerInfo("judge", "openclaw-prm/1")]


def _scored(
    traj: ReadyTrajectory, branches: list[BranchResult], turn_results: list[PRMTurnResult], stats: dict[str, float]
) -> SessionResult:
    return SessionResult(
        session_id=traj.session_id,
        trajectory_id=traj.trajectory_id,
        status="scored",
        outcome_reward=traj.outcome_reward,
        is_eval=traj.is_eval,
        policy_version=traj.policy_version,
        branches=branches,
        turn_results=turn_results,
        stats=stats,
        turns=compact_turns(traj.interactions),
        created_at=traj.created_at,
        scored_at=traj.created_at + 0.5,
    )


def verdict_accepted() -> GroupVerdict:
    """The branching session scored: one uniform and one per-token reward turn per branch."""
    traj = ready_branching()
    root = TokenRewards.from_array(np.array([0.5, 0.5, 0.5], np.float32))
    step = TokenRewards.from_array(np.array([0.25, -0.25], np.float32))
    branches = [
        BranchResult(
            leaf_id="leaf-a",
            path=["root", "step", "leaf-a"],
            token_rewards={
                "root": root,
                "step": step,
                "leaf-a": TokenRewards.from_array(np.array([1.0, 1.0, 1.0, 1.0], np.float32)),
            },
            scorer_totals={"length_budget": 1.0, "judge": 0.5},
        ),
        BranchResult(
            leaf_id="leaf-b",
            path=["root", "step", "leaf-b"],
            token_rewards={
                "root": root,
                "step": step,
                "leaf-b": TokenRewards.from_array(np.array([-1.0, -1.0], np.float32)),
            },
            scorer_totals={"length_budget": 0.0, "judge": -0.5},
            channels={"judge": {"leaf-b": TokenRewards.from_array(np.array([-1.0, -1.0], np.float32))}},
        ),
    ]
    turn_results = [
        PRMTurnResult(
            interaction_id="leaf-a",
            scorer_name="judge",
            reward=1.0,
            observations=(
                PRMMetricObservation(
                    metric_id="judge/parse_ok",
                    scope="turn",
                    target_id="leaf-a",
                    value=True,
                    value_type="boolean",
                    aggregations=("count", "rate"),
                ),
            ),
        ),
        PRMTurnResult(interaction_id="leaf-b", scorer_name="judge", reward=-1.0),
    ]
    stats = {"rollout/prm/judge/reward": 0.0, "rollout/prm/judge/reward__count": 2.0}
    return GroupVerdict(
        group_id=traj.group_id,
        status="accepted",
        verdict_version=1,
        group_size=1,
        sessions=[_scored(traj, branches, turn_results, stats)],
        scorers=_SCORERS,
        worker_id="w0.1",
        decided_at=T0 + 3,
        timings={"group_open_s": 1.25},
    )


def verdict_reference() -> GroupVerdict:
    """``verdict_accepted`` as published with ``worker.verdict_tokens: reference``: the member
    names its ``ready`` record in the trajectories topic instead of carrying its token turns."""
    full = verdict_accepted()
    (session,) = full.sessions
    return msgspec.structs.replace(
        full, sessions=[msgspec.structs.replace(session, turns=[], tokens_at=TokenRef(partition=3, offset=1207))]
    )


def verdict_rejected() -> GroupVerdict:
    """Two members: one scored, one whose scorer failed -> the whole group is rejected."""
    ok = ready_single_turn()
    branch = BranchResult(
        leaf_id="i0",
        path=["i0"],
        token_rewards={"i0": TokenRewards(length=4, uniform=1.0)},
        scorer_totals={"length_budget": 1.0},
    )
    failed = SessionResult.failure(
        code="scorer_timeout",
        detail="judge took > 60.0s",
        scorer="judge",
        session_id="g-vec-1/s1",
        trajectory_id="g-vec-1/t1",
        outcome_reward=0.0,
        policy_version=3,
        created_at=T0,
        scored_at=T0 + 60,
    )
    return GroupVerdict(
        group_id=ok.group_id,
        status="rejected",
        reason_code="scorer_timeout",
        reason="scorer_timeout: member 'g-vec-1/t1' (session 'g-vec-1/s1'): judge took > 60.0s",
        verdict_version=1,
        group_size=2,
        sessions=[
            _scored(
                ok,
                [branch],
                [PRMTurnResult(interaction_id="i0", scorer_name="length_budget", reward=1.0)],
                {"rollout/prm/length_budget/reward": 1.0},
            ),
            failed,
        ],
        scorers=_SCORERS[:1],
        worker_id="w1.1",
        decided_at=T0 + 61,
        timings={"group_open_s": 61.0},
    )


def verdict_discarded() -> GroupVerdict:
    """A discarded group lists the members that had arrived, without results."""
    return GroupVerdict(
        group_id="g-vec-3",
        status="discarded",
        reason="prompt filtered by the proxy",
        reason_code="discarded",
        verdict_version=1,
        group_size=4,
        sessions=[
            SessionResult(
                session_id="g-vec-3/s0",
                trajectory_id="g-vec-3/t0",
                status="discarded",
                outcome_reward=1.0,
                created_at=T0,
            )
        ],
        worker_id="w0.1",
        decided_at=T0 + 2.5,
        timings={"group_open_s": 2.5},
    )


def verdict_experiment() -> GroupVerdict:
    """``verdict_discarded`` of experiment ``exp-a``: the verdict names it (left out for ``default``)."""
    return msgspec.structs.replace(verdict_discarded(), experiment_id="exp-a")


VECTORS = {
    "ready_single_turn": ready_single_turn,
    "ready_experiment": ready_experiment,
    "ready_branching": ready_branching,
    "ready_compact": ready_compact,
    "chunk_0": chunk_0,
    "chunk_1": chunk_1,
    "discard": discard,
    "turn_root": turn_root,
    "turn_compact": turn_compact,
    "end_session": end_session,
    "verdict_accepted": verdict_accepted,
    "verdict_reference": verdict_reference,
    "verdict_rejected": verdict_rejected,
    "verdict_discarded": verdict_discarded,
    "verdict_experiment": verdict_experiment,
}


# --------------------------------------------------------------------------- readable twin
def readable(value: Any, key: str | None = None) -> Any:
    """The decoded msgpack tree with every packed array replaced by its numbers.

    ``{"$packed": "<i4", "values": [...]}`` marks a msgpack ``bin`` that holds a
    little-endian int32 (``<i4``) or float32 (``<f4``) array; ``{"$bytes": "hex"}`` a
    ``bin`` that is plain bytes (a chunk's ``data``).
    """
    if isinstance(value, bytes) and key in BYTES_KEYS:
        return {"$bytes": value.hex()}
    if isinstance(value, bytes):
        dtype = PACKED_KEYS.get(key or "")
        if dtype is None:
            raise ValueError(f"bytes under unexpected key {key!r}")
        return {"$packed": dtype, "values": np.frombuffer(value, dtype=dtype).tolist()}
    if isinstance(value, dict):
        return {k: readable(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v, key) for v in value]
    return value


def dumps(value: Any, indent: str = "") -> str:
    """JSON with one key per line but lists of numbers/strings on one line (readable diffs)."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + dumps(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value)


def record(message: Any) -> tuple[bytes, dict[str, Any]]:
    value, headers = encode(message)
    kind = dict(headers)["prm-kind"].decode()
    twin = {
        "topic": TOPICS[kind],
        "key": message.group_id,
        "headers": {k: v.decode() for k, v in headers},
        "value": readable(msgspec.msgpack.decode(value)),
    }
    return value, twin


def main() -> None:
    for name, build in VECTORS.items():
        value, twin = record(build())
        (HERE / f"{name}.msgpack").write_bytes(value)
        (HERE / f"{name}.json").write_text(dumps(twin) + "\n")
        print(f"{name}: {len(value)} bytes")


if __name__ == "__main__":
    main()
