"""End -> verdict latency of streamed sessions beside the ready form, with a fixed-latency judge.

One in-process worker scores groups of ``--group-size`` sessions with the OpenClaw judge
(``m = 3``) against a :class:`~prm_pipeline.demo.fake_judge.FakeJudgeServer` that answers
every request after ``--latency`` seconds (0.5 s by default), on the embedded broker
and a real redis-server. For each session length (``--lengths``, default 10, 100 and
1,000 turns) it runs ``--groups`` groups in each form, interleaved (ready, streamed,
ready, ...), so both forms see the same machine:

* **ready**: every member published whole; latency = verdict arrival - the moment the
  last member's ``publish`` + ``flush`` returned (what the trainer waits after the
  session ends, as before streaming);
* **streamed**: the members' turns published as an agent produces them, one turn per
  member every ``--gap`` seconds (slow enough for the judge to keep up: a turn costs
  ``3 x --latency`` request-seconds, and the worker keeps ``--judge-concurrency`` in
  flight), then the ``end`` records ``--end-after`` seconds after
  the last turn (the environment computing the outcome); latency = verdict arrival - the
  moment the ``end`` records' ``flush`` returned.

Also reported: the Redis memory an open streamed session holds per parked turn (its
compact turns and streamed judge results, ``MEMORY USAGE`` of its hash just before its
end), and per form the judge's peak requests in flight against their mean over the
form's run (sampled every 10 ms from the judge server): the ready form sends a
session's whole judge work in one burst at its end, the streamed form spreads it over
the session. Run with ``--end-after 0`` to see the last judged turn's call inside the
streamed latency (the end then arrives while it is still running).

This is a report, not a gate: nothing is asserted. Run:
``prm-pipeline bench streaming`` (about 5 minutes) or
``python -m tests.perf.bench_streaming --lengths 10,100 --groups 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import redis.asyncio as aioredis

from infra.config import (
    ActorConfig,
    AgentConfig,
    KafkaConfig,
    PipelineConfig,
    PRMConfig,
    PRMScorerConfig,
    RedisConfig,
    RolloutConfig,
    TopicsConfig,
    WorkerConfig,
)
from infra.local import LocalStack
from infra.schema import ReadyTrajectory, stream_session
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from prm_pipeline.demo.synthetic import make_session
from prm_pipeline.observe import VerdictTail
from producers.publisher import TrajectoryPublisher
from scoring_workers.session_store import session_key
from tests.integration.harness import running_worker


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lengths", default="10,100,1000", help="turns per session, comma-separated")
    parser.add_argument("--groups", default="5,3,1", help="groups per form for each length (default 5,3,1)")
    parser.add_argument("--group-size", type=int, default=2, help="sessions per group (default 2)")
    parser.add_argument("--latency", type=float, default=0.5, help="judge latency in seconds (default 0.5)")
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between a session's turns (default 0.1)")
    parser.add_argument(
        "--judge-concurrency",
        type=int,
        default=64,
        help="judge requests a worker keeps in flight (the judge's capacity; default 64)",
    )
    parser.add_argument(
        "--end-after",
        type=float,
        default=1.0,
        help="seconds between a streamed session's last turn and its end (default 1.0)",
    )
    return parser.parse_args(argv)


def _config(stack: LocalStack, judge: FakeJudgeServer, args: argparse.Namespace) -> PipelineConfig:
    name = uuid.uuid4().hex[:8]
    scorer = PRMScorerConfig(
        "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
        kwargs={
            "base_url": judge.base_url,
            "model": "fake-judge",
            "temperature": 0.0,
            "max_tokens": 64,
            "m": 3,
            "adaptive": False,
            "timeout_s": 30.0,
            "max_concurrency": args.judge_concurrency,
            # The fake judge shares this process: under the ready form's bursts a connection may
            # fail; the breaker would then fail the next form's calls fast for its reset time
            # (streamed turns whose call failed are judged again at the end, which measures the
            # breaker, not streaming). Retried instead.
            "max_retries": 5,
            "breaker_failure_threshold": 1_000_000,
        },
    )
    return PipelineConfig(
        rollout=RolloutConfig(agent=AgentConfig(prm=PRMConfig(scorers=[scorer]))),
        actor=ActorConfig(token_rewards_as_adv=True),
        kafka=KafkaConfig(
            bootstrap=stack.kafka_bootstrap,
            **{**stack.client_settings, "linger_ms": 1},
            max_message_bytes=8 * 1024 * 1024,
        ),
        redis=RedisConfig(url=stack.redis_url, key_prefix=f"bench:{name}", ttl_s=600),
        topics=TopicsConfig(
            trajectories=f"traj.{name}",
            verdicts=f"verd.{name}",
            dead_letters=f"dlq.{name}",
            experiments=f"exp.{name}",
            partitions=4,
        ),
        worker=WorkerConfig(group_id=f"workers.{name}", group_timeout_s=900, scorer_timeout_s=900),
    )


def _group(gid: str, size: int, turns: int, rng: np.random.Generator) -> list[ReadyTrajectory]:
    return [
        make_session(
            trajectory_id=f"{gid}-{m}",
            session_id=f"{gid}-s{m}",
            group_id=gid,
            group_size=size,
            turns=turns,
            output_tokens=(16, 64),
            rng=rng,
        )
        for m in range(size)
    ]


class _InFlight:
    """Samples the judge's requests in flight every 10 ms while a form runs."""

    def __init__(self, judge: FakeJudgeServer) -> None:
        self.judge = judge
        self.samples: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _InFlight:
        async def sample() -> None:
            while True:
                self.samples.append(self.judge.in_flight)
                await asyncio.sleep(0.01)

        self._task = asyncio.create_task(sample())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def _ready(pub: TrajectoryPublisher, tail: VerdictTail, members: list[ReadyTrajectory]) -> float:
    for traj in members:
        await pub.publish_ready(msgspec.structs.replace(traj, created_at=time.time()))
    await pub.flush()
    t0 = time.perf_counter()
    await tail.wait_for({members[0].group_id}, 900)
    return tail.arrivals[members[0].group_id] - t0


async def _streamed(
    pub: TrajectoryPublisher,
    tail: VerdictTail,
    members: list[ReadyTrajectory],
    gap: float,
    end_after: float,
    held: list[float],
    redis: aioredis.Redis,
    prefix: str,
) -> float:
    split = [stream_session(t) for t in members]
    for k in range(max(len(turns) for turns, _ in split)):
        for turns, _ in split:
            if k < len(turns):
                await pub.publish_turn(turns[k])
        await pub.flush()
        await asyncio.sleep(gap)
    await asyncio.sleep(end_after)
    key = session_key(prefix, members[0].group_id, members[0].trajectory_id)  # the default experiment's group key
    held.append(int(await redis.memory_usage(key, samples=0) or 0) / len(members[0].interactions))
    for _, end in split:
        await pub.end_session(end)
    await pub.flush()
    t0 = time.perf_counter()
    await tail.wait_for({members[0].group_id}, 900)
    return tail.arrivals[members[0].group_id] - t0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _bench(args: argparse.Namespace) -> list[dict[str, object]]:
    lengths = [int(x) for x in args.lengths.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    groups += [groups[-1]] * (len(lengths) - len(groups))
    rng = np.random.default_rng(0)
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="prm-bench-") as tmp,
        LocalStack(Path(tmp) / "stack") as stack,
        FakeJudgeServer(latency_ms=args.latency * 1000) as judge,
    ):
        cfg = _config(stack, judge, args)
        redis = aioredis.from_url(stack.redis_url)
        async with running_worker(cfg, "bench-worker"), TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            tail = VerdictTail(cfg)
            await tail.start()
            try:
                await _ready(pub, tail, _group("warm-up", 1, 2, rng))  # clients connected, partitions assigned
                # As the worker command does once ready (prm_pipeline.cli): start-up's objects out
                # of the collector's sight, or every full collection walks them again.
                gc.collect()
                gc.freeze()
                for turns, n in zip(lengths, groups):
                    lat: dict[str, list[float]] = {"ready": [], "streamed": []}
                    held: list[float] = []
                    load: dict[str, list[int]] = {"ready": [], "streamed": []}
                    for g in range(n):
                        for form in ("ready", "streamed"):
                            members = _group(f"{form}-{turns}-{g}", args.group_size, turns, rng)
                            async with _InFlight(judge) as sampled:
                                if form == "ready":
                                    lat[form].append(await _ready(pub, tail, members))
                                else:
                                    lat[form].append(
                                        await _streamed(
                                            pub,
                                            tail,
                                            members,
                                            args.gap,
                                            args.end_after,
                                            held,
                                            redis,
                                            cfg.redis.key_prefix,
                                        )
                                    )
                            load[form] += sampled.samples
                    for form in ("ready", "streamed"):
                        busy = load[form]
                        rows.append(
                            {
                                "turns": turns,
                                "form": form,
                                "groups": n,
                                "p50": _pct(lat[form], 0.5),
                                "p99": _pct(lat[form], 0.99),
                                "peak": max(busy, default=0),
                                "mean": statistics.fmean(busy) if busy else 0.0,
                                "held": statistics.fmean(held) if form == "streamed" else 0.0,
                            }
                        )
                        print(_line(rows[-1]), flush=True)
            finally:
                await tail.aclose()
                await redis.aclose()
    return rows


def _line(r: dict[str, object]) -> str:
    ratio = r["peak"] / r["mean"] if r["mean"] else float("nan")  # type: ignore[operator]
    held = f"{r['held']:>9.0f}" if r["form"] == "streamed" else f"{'':>9}"
    return (
        f"{r['turns']:>6} {r['form']:>9} {r['groups']:>7} {r['p50']:>8.3f} {r['p99']:>8.3f} "
        f"{r['peak']:>6} {r['mean']:>7.1f} {ratio:>9.1f} {held}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    print(
        f"bench_streaming: groups of {args.group_size} sessions, OpenClaw judge m=3 at {args.latency:g} s per "
        f"request, one in-process worker; streamed turns every {args.gap:g} s, end {args.end_after:g} s after "
        "the last turn"
    )
    print(
        f"{'turns':>6} {'form':>9} {'groups':>7} {'p50 s':>8} {'p99 s':>8} {'peak':>6} {'mean':>7} {'peak/mean':>9} "
        f"{'B/turn':>9}   (end -> verdict; judge requests in flight; Redis bytes per parked turn before the end)"
    )
    rows = asyncio.run(_bench(args))
    for turns in sorted({r["turns"] for r in rows}):  # type: ignore[type-var]
        ready = next(r for r in rows if r["turns"] == turns and r["form"] == "ready")
        streamed = next(r for r in rows if r["turns"] == turns and r["form"] == "streamed")
        print(
            f"{turns} turns: streamed p50 is {streamed['p50'] / ready['p50']:.3f}x the ready form's "  # type: ignore[operator]
            f"(p99 {streamed['p99'] / ready['p99']:.3f}x)"
        )  # type: ignore[operator]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
