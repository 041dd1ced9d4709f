"""The OpenClaw judge through the real pipeline: publisher -> two worker processes -> verdicts.

A :class:`FakeJudgeServer` runs in this process (a real HTTP server on loopback); two
``prm-pipeline worker`` processes score with :class:`OpenClawJudgeScorer` pointed at it
(greedy, ``m = 3``, adaptive voting), against the embedded broker and Redis.

* judged groups are accepted with the per-turn rewards the fake judge's rules and
  ``[[votes: ...]]`` markers script, the per-scorer channel travels with them, and the
  trainer's exclusion policy applies to them;
* a judge outage rejects groups with ``judge_failed`` while the workers stay up, and
  the pipeline recovers when the judge returns; every published group gets exactly one
  verdict;
* no judge request is ever waited on longer than its per-call timeout: the judge's own
  request log (:class:`LoggingJudge`) records when each client hung up.

One pair of workers serves the module (start-up dominates the runtime); each test uses
its own group ids and prompt texts.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from infra.config import (
    PipelineConfig,
    PRMScorerConfig,
)
from infra.schema import GroupVerdict, Interaction, ModelResponse, ReadyTrajectory, decode_verdict
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from producers.publisher import TrajectoryPublisher
from shaper import apply_exclusion, build_training_batch
from tests.integration.harness import isolated_config, read_topic, wait_for_verdicts, worker_processes

pytestmark = pytest.mark.integration

JUDGE = "openclaw_judge"
TIMEOUT_S = 1.0  # one judge HTTP attempt (the scorer's timeout_s)
MARGIN_S = 1.5  # scheduling slack on a loaded machine; far below the slow judge's latency
SLOW_LATENCY_MS = 8000.0
BREAKER_RESET_S = 0.5
PUBLISHED: list[str] = []  # every group this module publishes: each must get exactly one verdict


class LoggingJudge(FakeJudgeServer):
    """The fake judge plus a per-request log: arrival, end, and when the client hung up.

    While a request waits out the injected latency, its handler watches the connection:
    a client that gives up closes it (no pipelining on HTTP/1.1 keep-alive, so the only
    thing that can arrive is EOF or a reset), and the handler records that moment and
    stops waiting. A request the client kept waiting for would instead run its full
    latency and be answered — which is what the timeout test rules out.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._local = threading.local()
        self._settled = threading.Condition()
        self.log: list[dict] = []
        self._open = 0

    def _track(self, conn: socket.socket, add: bool) -> None:
        super()._track(conn, add)
        if add:
            self._local.conn = conn

    def _respond(self, path: str, raw: bytes):
        entry = {"path": path, "start": time.monotonic(), "abandoned": None, "body": raw}
        self._local.entry = entry
        with self._settled:
            self.log.append(entry)
            self._open += 1
        try:
            out = super()._respond(path, raw)
            entry["status"] = out[0]
            return out
        finally:
            entry["end"] = time.monotonic()
            with self._settled:
                self._open -= 1
                self._settled.notify_all()

    def _sleep(self, seconds: float) -> None:
        conn, entry = self._local.conn, self._local.entry
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not self._stopping.is_set():
            readable, _, _ = select.select([conn], [], [], min(left, 0.02))
            if readable:
                try:
                    data = conn.recv(1, socket.MSG_PEEK)
                except OSError:  # reset by the client
                    data = b""
                if not data:
                    entry["abandoned"] = time.monotonic()
                    return

    def wait_settled(self, timeout: float) -> bool:
        """Block until no request is in progress (each ends answered or abandoned)."""
        with self._settled:
            return self._settled.wait_for(lambda: self._open == 0, timeout)


@pytest.fixture(scope="module")
def judge():
    with LoggingJudge() as server:
        yield server


@pytest.fixture(scope="module")
def cfg(kafka_bootstrap: str, redis_url: str, judge: LoggingJudge) -> PipelineConfig:
    name = f"judge-{uuid.uuid4().hex[:8]}"
    scorer = PRMScorerConfig(
        "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
        kwargs={
            "base_url": judge.base_url,
            "model": "fake-judge",
            "temperature": 0.0,
            "max_tokens": 64,
            "m": 3,
            "adaptive": True,
            "on_all_votes_failed": "reject",
            "timeout_s": TIMEOUT_S,
            "total_timeout_s": 1.5,
            "max_retries": 1,
            "backoff_base_s": 0.05,
            "backoff_max_s": 0.1,
            "breaker_failure_threshold": 3,
            "breaker_reset_s": BREAKER_RESET_S,
        },
    )
    return isolated_config(
        name,
        kafka_bootstrap,
        redis_url,
        scorers=[scorer],
        scorer_timeout_s=15,
        group_timeout_s=60,
        allowed_scorer_modules=["scoring_workers.scorers"],
        keep_scorer_channels=True,
    )


@pytest.fixture(scope="module")
async def workers(cfg: PipelineConfig, tmp_path_factory: pytest.TempPathFactory):
    async with worker_processes(cfg, tmp_path_factory.mktemp("judge-workers")) as procs:
        yield procs


# --------------------------------------------------------------------------- trajectories
def judged_trajectory(
    gid: str, sid: str, group_size: int, next_states: Sequence[tuple[str, str]], *, outcome: float = 1.0
) -> ReadyTrajectory:
    """A concat-export session with one turn per next state plus a last turn without one.

    Turn ``k``'s messages are the conversation before its output; its output is answered
    by ``next_states[k]`` (``(role, text)``), which the judge sees as evidence. Texts
    carry the session id, so scripted ``[[votes: ...]]`` prompts never collide.
    """
    rng = np.random.default_rng(abs(hash(sid)) % (1 << 32))
    messages: list[dict] = [{"role": "user", "content": f"task {sid}"}]
    context = rng.integers(1, 32_000, 8, dtype=np.int32)
    interactions: list[Interaction] = []
    parent = None
    for k in range(len(next_states) + 1):
        out = rng.integers(1, 32_000, 4 + k, dtype=np.int32)
        answer = {"role": "assistant", "content": f"answer {k} of {sid}"}
        iid = f"{sid}-t{k}"
        interactions.append(
            Interaction(
                interaction_id=iid,
                parent_id=parent,
                messages=list(messages),
                output_message_list=[answer],
                model_response=ModelResponse.from_arrays(context, out, np.full(out.size, -0.5, np.float32), "stop"),
            )
        )
        parent = iid
        messages.append(answer)
        if k < len(next_states):
            role, text = next_states[k]
            messages.append({"role": role, "content": text})
            context = np.concatenate([context, out, rng.integers(1, 32_000, 3, dtype=np.int32)])
    return ReadyTrajectory(
        trajectory_id=f"{sid}-traj",
        session_id=sid,
        group_id=gid,
        group_size=group_size,
        interactions=interactions,
        outcome_reward=outcome,
        created_at=time.time(),
    )


def plain_group(tag: str, size: int = 2) -> tuple[str, list[ReadyTrajectory]]:
    """A group whose turns the judge's rules score +1 (a successful tool result) then 0 (last turn)."""
    gid = f"{tag}-{uuid.uuid4().hex[:6]}"
    members = [
        judged_trajectory(gid, f"{gid}-s{i}", size, [("tool", "ok, success")], outcome=float(i % 2))
        for i in range(size)
    ]
    return gid, members


async def publish(cfg: PipelineConfig, messages: Sequence[ReadyTrajectory]) -> None:
    PUBLISHED.extend(dict.fromkeys(m.group_id for m in messages))
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.publish_many(list(messages))


async def verdict_of(cfg: PipelineConfig, gid: str) -> GroupVerdict:
    verdicts = [v for v in await wait_for_verdicts(cfg, [gid], timeout_s=45) if v.group_id == gid]
    return verdicts[0]


async def assert_one_verdict_per_group(cfg: PipelineConfig) -> None:
    records = await read_topic(cfg, cfg.topics.verdicts)
    counts = Counter(decode_verdict(r.value, r.headers).group_id for r in records)
    assert {g: counts[g] for g in PUBLISHED if counts[g] != 1} == {}, "lost or duplicated verdicts"


def judge_rewards(session) -> list[float]:
    (branch,) = session.branches
    by_turn = {tr.interaction_id: tr.reward for tr in session.turn_results if tr.scorer_name == JUDGE}
    return [by_turn[iid] for iid in branch.path]


def observed(session, metric: str) -> list[float]:
    (branch,) = session.branches
    values = {
        tr.interaction_id: next(o.value for o in tr.observations if o.metric_id == metric)
        for tr in session.turn_results
        if tr.scorer_name == JUDGE
    }
    return [values[iid] for iid in branch.path]


# --------------------------------------------------------------------------- tests
async def test_judged_group_is_accepted_with_scripted_turn_rewards(cfg, workers, judge) -> None:
    gid = f"acc-{uuid.uuid4().hex[:6]}"
    a = judged_trajectory(
        gid,
        f"{gid}-a",
        2,
        [
            ("tool", "ok, the file was written (success)"),  # rule: positive -> +1
            ("user", "That is wrong, please redo it"),  # rule: negative -> -1
        ],
    )  # third turn: no next state -> 0, no call
    b = judged_trajectory(
        gid,
        f"{gid}-b",
        2,
        [
            ("user", f"[[votes: 1, 0, -1]] {gid}"),  # split 1/0/-1 -> 0 after three calls
            ("user", f"[[votes: x, 1, 1]] {gid}"),  # one unparsable vote, then 1, 1 -> 1
            ("tool", f"[[votes: -1, -1, 1]] {gid}"),  # two agreeing votes settle it -> -1 (2 calls)
        ],
        outcome=0.0,
    )
    await publish(cfg, [a, b])
    verdict = await verdict_of(cfg, gid)
    assert verdict.status == "accepted", (verdict.reason, [s.error for s in verdict.sessions])
    assert [s.name for s in verdict.scorers] == [JUDGE]
    by_id = {s.session_id: s for s in verdict.sessions}
    sa, sb = by_id[f"{gid}-a"], by_id[f"{gid}-b"]
    assert judge_rewards(sa) == [1.0, -1.0, 0.0]
    assert judge_rewards(sb) == [0.0, 1.0, -1.0, 0.0]
    assert observed(sa, "has_next_state") == [True, True, False]
    assert observed(sb, "judge_calls") == [3.0, 3.0, 2.0, 0.0]  # adaptive: the last judged turn saved one
    assert observed(sb, "judge_votes_invalid") == [0.0, 1.0, 0.0, 0.0]
    asked = [json.loads(e["body"]) for e in judge.log if gid in e["body"].decode(errors="replace")]
    assert len(asked) == (3 + 3 + 2) + 2 * 2  # b: scripted calls; a: two judged turns, 2 agreeing votes each
    assert {(p["temperature"], p["model"]) for p in asked} == {(0.0, "fake-judge")}  # greedy judge
    for session in (sa, sb):
        (branch,) = session.branches
        rewards = judge_rewards(session)
        for iid, value in zip(branch.path, rewards):
            assert branch.token_rewards[iid].uniform == value
            assert branch.channels[JUDGE][iid] == branch.token_rewards[iid]  # worker.keep_scorer_channels
    # The trainer's exclusion policy on these verdicts: neutral turns and last turns out.
    batch = build_training_batch([verdict])
    keep = apply_exclusion(batch)
    for row, session in enumerate(batch.session_ids):
        kept_turns = sorted(set(batch.turn_index[row][keep[row]].tolist()))
        assert kept_turns == ([0, 1] if session == f"{gid}-a" else [1, 2]), session


async def test_judge_outage_rejects_groups_then_recovers(cfg, workers, judge) -> None:
    assert workers.alive() == [True, True]
    judge.set_outage(True)
    try:
        gid, members = plain_group("out")
        await publish(cfg, members)
        verdict = await verdict_of(cfg, gid)
    finally:
        judge.set_outage(False)
    assert verdict.status == "rejected" and verdict.reason_code == "judge_failed", verdict.reason
    assert verdict.reason.startswith("judge_failed: member "), verdict.reason
    assert all(s.status == "failed" and s.error.startswith("judge_failed") for s in verdict.sessions)
    assert all(not s.branches and not s.stats for s in verdict.sessions)  # no partial results
    assert judge.statuses[503] > 0
    assert workers.alive() == [True, True]
    # The judge is back. A worker's circuit breaker may still fail fast for up to
    # breaker_reset_s (then one probe closes it); a group scored meanwhile is rejected
    # without reaching the judge. Publish until one is accepted (bounded).
    back = len(judge.log)
    t_back = time.monotonic()
    for _ in range(10):
        gid, members = plain_group("back")
        await publish(cfg, members)
        verdict = await verdict_of(cfg, gid)
        if verdict.status == "accepted":
            break
        assert verdict.reason_code == "judge_failed", verdict.reason
        assert all("circuit_open" in s.error for s in verdict.sessions if s.status == "failed"), [
            s.error for s in verdict.sessions
        ]
    assert verdict.status == "accepted", "no recovery after the judge came back"
    assert time.monotonic() - t_back < 30
    assert [judge_rewards(s) for s in verdict.sessions] == [[1.0, 0.0], [1.0, 0.0]]
    assert all(e.get("status") == 200 for e in judge.log[back:])  # nothing the judge answered failed
    assert workers.alive() == [True, True]
    await assert_one_verdict_per_group(cfg)


async def close_every_breaker(cfg: PipelineConfig) -> None:
    """Healthy groups until both workers have scored one: an earlier outage may have left a
    worker's circuit breaker open (it closes on its next successful call), and a worker
    failing fast would send nothing to the slow judge below."""
    deciders: set[str] = set()
    for _ in range(30):
        gid, members = plain_group("warm")
        await publish(cfg, members)
        verdict = await verdict_of(cfg, gid)
        if verdict.status == "accepted":
            deciders.add(verdict.worker_id)
            if len(deciders) == 2:
                return
    raise AssertionError(f"only {sorted(deciders)} accepted a group; a breaker stayed open")


async def test_no_judge_request_waits_past_its_timeout(cfg, workers, judge) -> None:
    """A judge slower than the per-call timeout: every request is abandoned within timeout + margin.

    The evidence is the judge's own log: for each request of the slow window, the moment
    its client hung up (the server notices the connection closing while it waits out
    the latency). A client that kept waiting would show up as a request that ran the
    full 8 s latency and was answered.
    """
    await close_every_breaker(cfg)
    assert judge.wait_settled(10)
    start = len(judge.log)
    judge.latency_ms = SLOW_LATENCY_MS
    try:
        gid, members = plain_group("slow")
        await publish(cfg, members)
        verdict = await verdict_of(cfg, gid)
        # Every request of the window ends, answered or abandoned, before we read the log.
        assert await asyncio.to_thread(judge.wait_settled, SLOW_LATENCY_MS / 1000 + 5)
    finally:
        judge.latency_ms = 0.0
    window = judge.log[start:]
    assert window, "no judge request reached the slow judge"
    waited = [e["abandoned"] - e["start"] if e["abandoned"] is not None else e["end"] - e["start"] for e in window]
    assert all(e["abandoned"] is not None for e in window), f"answered after waiting: {waited}"
    assert max(waited) <= TIMEOUT_S + MARGIN_S, waited
    assert verdict.status == "rejected" and verdict.reason_code == "judge_failed", verdict.reason
    # The members did not wait for the slow judge either: each was finished (failed)
    # sooner after it was created than a single slow answer takes.
    assert all(s.scored_at - s.created_at < SLOW_LATENCY_MS / 1000 for s in verdict.sessions), [
        s.scored_at - s.created_at for s in verdict.sessions
    ]
    assert all("timeout" in s.error or "circuit_open" in s.error for s in verdict.sessions if s.status == "failed")
    # The pipeline is healthy afterwards: a normal group goes through.
    for _ in range(10):
        gid, members = plain_group("after")
        await publish(cfg, members)
        verdict = await verdict_of(cfg, gid)
        if verdict.status == "accepted":
            break
        assert all("circuit_open" in s.error for s in verdict.sessions if s.status == "failed")
    assert verdict.status == "accepted"
    assert workers.alive() == [True, True]
    await assert_one_verdict_per_group(cfg)
