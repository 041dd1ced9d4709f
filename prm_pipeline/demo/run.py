"""``make demo``: a tiny real LM trained through the pipeline, in a closed loop, with a report.

1. start the embedded Kafka-protocol broker and Redis, create the topics; start the
   scripted judge (:class:`~prm_pipeline.demo.fake_judge.FakeJudgeServer`, for the
   ``\\boxed{}`` votes: a random LM cannot judge) and ``prm-pipeline model-server`` (the
   tiny LM as the OPD teacher: real log-probs over SGLang ``/generate``);
2. start two ``prm-pipeline worker`` processes. Scorers: the config file's (the length
   budget, its limit lowered to 12 tokens so it varies here), plus OpenClaw-RL's PRM
   judge and the OPD teacher; shaping ``additive`` (the judge and OPD signals are
   signed), per-scorer channels kept for the report;
3. each iteration: the rollout proxy (:mod:`prm_pipeline.demo.rollout_proxy`) reloads the newest
   published weights, samples ``prompts`` GRPO groups of multi-turn sessions (some
   branching) against a calculator tool and a user simulator, and publishes them with
   their ``policy_version`` (plus one discarded group; the first iteration also sends a
   group whose last member never arrives, rejected at the group deadline, and one with a
   member that is not concat export, rejected by the workers);
4. the reference trainer consumes the verdicts, shapes advantages and runs a PPO-clip
   step (:class:`prm_pipeline.demo.policy_update.PolicyUpdate`) on its own copy of the model, then
   publishes the new weights (``policy_version + 1``) for the proxy — the loop closes;
5. ``demo-report/index.html``: statuses over time, per-stage latency, reward
   distributions per scorer, outcome vs shaped advantages, loss / importance ratio /
   policy version per step, and token views of three sessions. Its path is printed.

Exit status 0 when every step ran, every verdict is what the proxy expected, the
workers exited cleanly and the first minibatch of every step was on-policy (recomputed
log-probs equal the behaviour log-probs to float noise).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from infra.config import PipelineConfig, PRMScorerConfig, load_config
from infra.kafka import ensure_topics
from infra.local import LocalStack, free_port
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from prm_pipeline.observe import VerdictTail
from producers.publisher import TrajectoryPublisher

DEMO_GROUP_TIMEOUT_S = 6.0
ALIGNMENT_TOLERANCE = 1e-4  # the demo's alarm; the tests hold the alignment to 1e-5
JUDGE = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"
OPD = "scoring_workers.scorers.opd.OPDTeacherScorer"
AUDIT_SINK = "prm_pipeline.inspect:record_judge_audit"


async def _await_verdicts(tail: VerdictTail, procs: WorkerProcesses, groups: set[str], timeout_s: float) -> None:
    """Wait for ``groups``' verdicts, failing at once with a worker's last log line if every worker exited."""
    waiter = asyncio.create_task(tail.wait_for(groups, timeout_s))
    while not waiter.done():
        if not any(procs.alive()):
            waiter.cancel()
            logs = sorted(procs.log_dir.glob("worker*.log"))
            lines = logs[-1].read_text(errors="replace").strip().splitlines() if logs else []
            raise RuntimeError(f"every scoring worker exited; last log line: {lines[-1] if lines else '(empty log)'}")
        await asyncio.wait({waiter}, timeout=0.2)
    await waiter


def demo_config(cfg: PipelineConfig, *, judge_url: str, teacher_url: str, prompts: int) -> PipelineConfig:
    """The configured pipeline plus the judge and OPD scorers, additive shaping, kept channels."""
    scorers = []
    for s in cfg.prm.scorers:
        if s.path.endswith("LengthBudgetScorer"):
            s = msgspec.structs.replace(s, kwargs={**s.kwargs, "max_output_tokens": 12})
        scorers.append(s)
    common = {"base_url": judge_url, "audit_sink": AUDIT_SINK, "temperature": 0.0, "timeout_s": 10.0}
    scorers += [
        PRMScorerConfig(path=JUDGE, weight=0.5, kwargs={**common, "m": 3}),
        PRMScorerConfig(path=OPD, weight=1.0, kwargs={**common, "m": 1, "teacher_base_url": teacher_url}),
    ]
    shaping = msgspec.structs.replace(cfg.prm.advantage_shaping, mode="additive")
    prm = msgspec.structs.replace(cfg.prm, scorers=scorers, advantage_shaping=shaping)
    agent = msgspec.structs.replace(cfg.rollout.agent, prm=prm)
    return msgspec.structs.replace(
        cfg,
        rollout=msgspec.structs.replace(cfg.rollout, agent=agent),
        # the judge's audit sink (record_judge_audit) is named in config, so it passes the allow-list
        worker=msgspec.structs.replace(cfg.worker, group_timeout_s=DEMO_GROUP_TIMEOUT_S, keep_scorer_channels=True,
                                       allowed_scorer_modules=[*cfg.worker.allowed_scorer_modules,
                                                               AUDIT_SINK.split(":")[0]]),
        trainer=msgspec.structs.replace(cfg.trainer, batch_groups=prompts, device="cpu"),
    )


class ModelServerProcess:
    """``prm-pipeline model-server`` as a child process; :meth:`wait_url` once it listens."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.port = free_port()  # known up front, so the workers can start while the model loads
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prm_pipeline.cli", "model-server", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=log_path.open("wb"), text=True)

    def wait_url(self) -> str:
        """Block until the server prints its URL (EOF, i.e. a crash, raises)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on " not in line:
            raise RuntimeError(f"model-server did not start: {line!r}; see {self.log_path}")
        return line.rsplit(" ", 1)[-1].strip()

    def stop(self) -> int | None:
        self.proc.terminate()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class _Loop:
    """The trainer half of the closed loop: PPO step, weight publishing, what the report needs."""

    def __init__(self, store: Any, seed: int) -> None:
        from prm_pipeline.demo.policy_update import PolicyUpdate
        from prm_pipeline.demo.tiny_model import TinyLMConfig, TinyPolicy

        self.policy = TinyPolicy.create(TinyLMConfig(seed=seed))  # the trainer's own copy
        self.updater = PolicyUpdate(self.policy.model)
        self.store = store
        self.version = 0
        self.done = asyncio.Event()
        self.records: list[dict[str, float]] = []
        self.advantages: list[tuple[float, float]] = []
        self.timings: list[dict[str, float]] = []
        self.rng = random.Random(seed)

    def __call__(self, batch: Any, shaped: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.updater.step(batch, shaped.advantages, shaped.loss_mask)
        t1 = time.perf_counter()
        self.version += 1
        self.store.publish(self.policy.model, self.version)
        t2 = time.perf_counter()
        mask = shaped.loss_mask
        pairs = list(zip(shaped.outcome_advantages[mask].tolist(), shaped.advantages[mask].tolist()))
        self.advantages += self.rng.sample(pairs, min(len(pairs), 600))
        record = {"step": float(len(self.records) + 1), "policy_version": float(self.version),
                  "rows": float(batch.batch_size), "mean_outcome": float(batch.rewards.mean()),
                  **stats.as_dict()}
        self.records.append(record)
        self.timings.append({"train step": t1 - t0, "publish weights": t2 - t1})
        self.done.set()
        return stats.as_dict()


async def _run(cfg: PipelineConfig, workdir: Path, out_dir: Path, *, updates: int, prompts: int,
               group_size: int, seed: int) -> int:
    import torch

    from prm_pipeline.demo.fake_judge import FakeJudgeServer
    from prm_pipeline.demo.report import DemoRecord, write_report
    from prm_pipeline.demo.rollout_proxy import RolloutConfig, RolloutProxy
    from prm_pipeline.demo.tiny_model import TinyLMConfig, TinyPolicy, WeightStore
    from prm_pipeline.inspect import AUDIT_ENV, branch_views, load_audit, render_html, verdict_record
    from shaper.trainer import run_trainer

    torch.set_num_threads(1)  # two shared cores: one thread each for the proxy and the trainer
    t_start = time.perf_counter()
    stage_setup: dict[str, float] = {}
    audit_path = workdir / "judge-audit.jsonl"
    os.environ[AUDIT_ENV] = str(audit_path)  # inherited by the workers (their judge audit sink)
    server = ModelServerProcess(workdir / "model-server.log")
    judge = FakeJudgeServer()
    judge.start()
    created = await ensure_topics(cfg.kafka, cfg.topics)
    print(f"topics: {', '.join(f'{n} ({s})' for n, s in created.items())}")
    teacher_url = f"http://127.0.0.1:{server.port}"
    cfg = demo_config(cfg, judge_url=judge.base_url, teacher_url=teacher_url, prompts=prompts)
    procs = WorkerProcesses(write_config(cfg, workdir / "config.yaml"), workdir, n=2)
    procs.start()
    store = WeightStore(workdir / "weights")
    policy = TinyPolicy.create(TinyLMConfig(seed=seed))
    store.publish(policy.model, 0)
    loop = _Loop(store, seed)
    if await asyncio.wait_for(asyncio.to_thread(server.wait_url), timeout=120) != teacher_url:
        raise RuntimeError(f"model-server is not listening on {teacher_url}; see {server.log_path}")
    stage_setup["model-server ready"] = time.perf_counter() - t_start
    n_params = sum(p.numel() for p in policy.model.parameters())
    print(f"tiny LM: Llama 2 layers, hidden 64, {n_params:,} parameters, vocab {policy.tokenizer.get_vocab_size()}; "
          f"teacher {teacher_url}; scripted judge {judge.base_url}")
    print("scorers: " + ", ".join(f"{s.path.rsplit('.', 1)[-1]}(weight={s.weight})" for s in cfg.prm.scorers)
          + f"; shaping {cfg.prm.advantage_shaping.mode}")
    tail = VerdictTail(cfg)
    await tail.start()
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.discard_group("demo-warmup", "warm-up probe")
    await _await_verdicts(tail, procs, {"demo-warmup"}, timeout_s=60)
    stage_setup["start-up"] = time.perf_counter() - t_start
    print(f"started 2 scoring workers and the model server in {stage_setup['start-up']:.1f}s (model server "
          f"ready after {stage_setup['model-server ready']:.1f}s; logs in {workdir})")

    proxy = RolloutProxy(policy, RolloutConfig(group_size=group_size, seed=seed), store=store)
    stop_trainer = asyncio.Event()
    trainer = asyncio.create_task(run_trainer(cfg, update=loop, batch_groups=prompts, stop=stop_trainer))
    expect: dict[str, tuple[str, str]] = {}  # group -> (status, reason code)
    record = DemoRecord()
    t0 = time.perf_counter()
    ok = True
    try:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            for it in range(updates):
                stage: dict[str, float] = {}
                ts = time.perf_counter()
                proxy.reload()
                stage["reload weights"] = time.perf_counter() - ts
                ts = time.perf_counter()
                groups = [proxy.group(f"it{it}-p{k}") for k in range(prompts)]
                lost = proxy.group("it0-lost")[:-1] if it == 0 else []  # its last rollout never finishes
                broken = _not_concat([proxy.session("it0-broken", i, "compute 1 + 1", turns=2, branch=False)
                                      for i in range(group_size)]) if it == 0 else []
                stage["rollout"] = time.perf_counter() - ts
                ts = time.perf_counter()
                loop.done.clear()
                await proxy.publish(pub, groups)
                expect.update({g[0].group_id: ("accepted", "") for g in groups})
                await pub.discard_group(f"it{it}-filtered", "prompt filtered by the proxy")
                expect[f"it{it}-filtered"] = ("discarded", "prompt filtered by the proxy")
                if lost:  # rejected at the group deadline
                    await pub.publish_many(lost)
                    expect["it0-lost"] = ("rejected", "missing_sessions")
                if broken:  # a member whose last turn was re-templated: refused by the workers
                    await pub.publish_many(broken)
                    expect["it0-broken"] = ("rejected", "not_concat_export")
                await pub.flush()
                stage["publish"] = time.perf_counter() - ts
                ts = time.perf_counter()
                await tail.wait_for({g[0].group_id for g in groups}, timeout_s=120)
                stage["scoring (publish -> verdicts)"] = time.perf_counter() - ts
                ts = time.perf_counter()
                await _wait_step(loop.done, trainer)
                stage["trainer consume"] = time.perf_counter() - ts - sum(loop.timings[-1].values())
                stage.update(loop.timings[-1])
                record.stages.append(stage)
                s = loop.records[-1]
                n_turns = sum(len(m.interactions) for g in groups for m in g)
                print(f"  iter {it}: policy v{groups[0][0].policy_version} sampled {len(groups)} groups "
                      f"({n_turns} turns) in {stage['rollout']:.2f}s, scored in "
                      f"{stage['scoring (publish -> verdicts)']:.2f}s; step {int(s['step'])}: loss "
                      f"{s['update/loss']:+.4f} ratio {s['update/ratio_min']:.3f}..{s['update/ratio_max']:.3f} "
                      f"clip {s['update/clip_fraction']:.2f} align |d|max {s['update/alignment_max_abs_diff']:.1e} "
                      f"mean outcome {s['mean_outcome']:.2f} -> policy v{int(s['policy_version'])}")
            proxy.reload()
            print(f"  proxy reloaded policy v{proxy.policy.version} (published after step {len(loop.records)})")
        await tail.wait_for(set(expect), timeout_s=DEMO_GROUP_TIMEOUT_S + 60)
        teacher_requests = _teacher_requests(teacher_url)
    finally:
        await tail.aclose()
        stop_trainer.set()  # graceful: the consumer commits and leaves its group
        done, _ = await asyncio.wait([trainer], timeout=30)
        if not done:
            trainer.cancel()
        summary = await asyncio.gather(trainer, return_exceptions=True)
        if isinstance(summary[0], BaseException) and not isinstance(summary[0], asyncio.CancelledError):
            print(f"  trainer failed: {summary[0]!r}")
            ok = False
        codes = procs.stop()
        server.stop()
        judge.stop()
    loop_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ checks and the report
    verdicts = {g: v for g, v in tail.verdicts.items() if g in expect}
    statuses = collections.Counter(v.status for v in verdicts.values())
    wrong = {g: (want, verdicts[g].status, verdicts[g].reason) for g, want in expect.items()
             if (verdicts[g].status, verdicts[g].reason.split(":", 1)[0]) != want}
    worst = max(s["update/alignment_max_abs_diff"] for s in loop.records)
    record.verdict_events = [(tail.arrivals[g] - t0, g, v.status) for g, v in verdicts.items()]
    record.steps = loop.records
    record.advantages = loop.advantages
    for v in verdicts.values():
        for s in v.sessions:
            for tr in s.turn_results:
                record.scorer_turn_rewards.setdefault(tr.scorer_name, []).append(tr.reward)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [verdict_record(v) for v in verdicts.values()]
    (out_dir / "verdicts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if audit_path.exists():
        (out_dir / "judge-audit.jsonl").write_bytes(audit_path.read_bytes())
    record.token_views_html = render_html(_sample_views(records, load_audit(audit_path), branch_views))
    record.summary = [
        f"{len(loop.records)} policy updates in {loop_s:.1f}s (start-up {stage_setup['start-up']:.1f}s, the model "
        f"server ready after {stage_setup['model-server ready']:.1f}s); "
        f"policy version {proxy.policy.version} at the end",
        f"verdicts: {dict(statuses)}; scripted-judge requests {judge.requests}, teacher (model-server) "
        f"requests {teacher_requests}",
        f"alignment: max |recomputed - behaviour| log-prob on the first minibatch of each step = {worst:.2e}",
        f"workers exited with {codes}",
    ]
    path = write_report(record, out_dir)
    print()
    print("summary")
    for line in record.summary:
        print(f"  {line}")
    if wrong:
        print(f"  UNEXPECTED verdicts: {dict(list(wrong.items())[:10])}")
    if worst > ALIGNMENT_TOLERANCE:
        print(f"  ALIGNMENT: recomputed log-probs differ from the behaviour log-probs by {worst:.2e}")
    ok = ok and not wrong and codes == [0, 0] and len(loop.records) == updates and worst <= ALIGNMENT_TOLERANCE
    print("demo OK" if ok else "demo FAILED")
    print(f"report: {path.resolve()}")
    return 0 if ok else 1


def _not_concat(members: list[Any]) -> list[Any]:
    """The group with its last member's last turn (not a root) changed inside its history: not concat export."""
    from infra.schema import Interaction, ModelResponse

    last = members[-1]
    turn = last.interactions[-1]
    mr = turn.model_response
    tokens = mr.input_tokens.copy()
    tokens[0] += 1  # the parent produced this prefix; a re-applied template would change it like this
    bad = Interaction(interaction_id=turn.interaction_id, parent_id=turn.parent_id, messages=turn.messages,
                      output_message_list=turn.output_message_list,
                      model_response=ModelResponse.from_arrays(tokens, mr.output_tokens, mr.output_logprobs,
                                                               mr.stop_reason))
    return [*members[:-1], msgspec.structs.replace(last, interactions=[*last.interactions[:-1], bad])]


async def _wait_step(done: asyncio.Event, trainer: asyncio.Task[Any], timeout_s: float = 120.0) -> None:
    """Wait for the trainer's next update; a trainer that died raises here instead of a time-out."""
    waiter = asyncio.ensure_future(done.wait())
    finished, _ = await asyncio.wait([waiter, trainer], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if waiter not in finished:
        waiter.cancel()
        if trainer in finished:
            trainer.result()  # re-raises the trainer's error
            raise RuntimeError(f"the trainer stopped before its next update ({trainer.result().stop_reason})")
        raise TimeoutError(f"no policy update within {timeout_s:.0f}s")


def _teacher_requests(url: str) -> int:
    import httpx

    return int(httpx.get(f"{url}/health", timeout=5).json().get("requests", 0))


def _sample_views(records: list[dict[str, Any]], audit: Any, branch_views: Any) -> list[Any]:
    """Three sessions of the last iteration: a branching one, a multi-turn one, a single-turn one."""
    views = [v for r in records if r["status"] == "accepted" for v in branch_views(r, audit)]
    last = max((v.group_id.split("-")[0] for v in views), default="")
    views = [v for v in views if v.group_id.startswith(last + "-")] or views
    sessions: dict[str, list[Any]] = {}
    for v in views:
        sessions.setdefault(v.session_id, []).append(v)
    picks: list[str] = []
    for want in ("branching", "multi", "single"):
        for sid, vs in sessions.items():
            n = max(len(v.turns) for v in vs)
            kind = "branching" if len(vs) > 1 else ("multi" if n > 1 else "single")
            if kind == want and sid not in picks:
                picks.append(sid)
                break
    return [v for sid in picks for v in sessions[sid]]


def run_demo(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    out_dir = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="prm-demo-") as tmp:
        with LocalStack(Path(tmp) / "stack", broker_binary=cfg.local.broker_binary,
                        redis_binary=cfg.local.redis_binary) as stack:
            print(f"embedded stack: kafka {stack.kafka_bootstrap}, redis {stack.redis_url}")
            cfg = msgspec.structs.replace(
                cfg,
                kafka=msgspec.structs.replace(cfg.kafka, bootstrap=stack.kafka_bootstrap, session_timeout_ms=3000,
                                              heartbeat_interval_ms=1000, leave_group_on_stop=False),
                redis=msgspec.structs.replace(cfg.redis, url=stack.redis_url),
            )
            workdir = Path(tmp) / "workers"
            workdir.mkdir()
            return asyncio.run(_run(cfg, workdir, out_dir, updates=args.updates, prompts=args.prompts,
                                    group_size=args.group_size, seed=args.seed))


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--updates", type=int, default=3, help="policy updates in the closed loop (default 3)")
    p.add_argument("--prompts", type=int, default=4, help="GRPO groups per update (default 4)")
    p.add_argument("--group-size", type=int, default=4, help="sessions per group (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo-report", help="report directory (default demo-report)")
