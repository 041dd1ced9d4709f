"""``make demo``: a tiny real LM learns through the pipeline, with and without process rewards.

Two runs train side by side through the same pipeline, from the same seed: ``outcome``
(GRPO on the outcome alone: the process rewards are computed but not used) and
``process`` (the outcome advantage plus the process rewards, ``additive`` shaping).
The task (:mod:`prm_pipeline.demo.rollout_proxy`) has a sparse outcome — a 3-turn
session succeeds only if every turn passed — while the judge marks each answered turn.

1. start the embedded Kafka-protocol broker and Redis, create the topics; start the
   scripted judge (:class:`~prm_pipeline.demo.fake_judge.FakeJudgeServer`, for the
   ``\\boxed{}`` votes: a random LM cannot judge) and ``prm-pipeline model-server`` (the
   tiny LM as the OPD teacher: real log-probs over SGLang ``/generate``);
2. start two ``prm-pipeline worker`` processes with OpenClaw-RL's PRM judge and the OPD
   teacher as scorers, per-scorer channels kept for the report;
3. each iteration, for each run: its rollout proxy reloads that run's newest weights,
   samples ``prompts`` GRPO groups of 3-turn sessions (some branching) and streams them
   with their ``policy_version``: each turn a ``turn`` record as soon as it is sampled
   and answered, each session's ``end`` (the outcome) after its last turn, so the
   workers judge turns while later ones are sampled (plus one discarded group; the
   first iteration also sends a group whose last member never arrives, rejected at the
   group deadline, and one with a member that is not concat export, rejected by the
   workers);
4. one reference trainer consumes the verdicts (both runs' groups of the update form
   one batch: exactly those, checked), shapes advantages, and steps each run's own model
   with PPO-clip (:class:`~prm_pipeline.demo.policy_update.PolicyUpdate`) on its rows,
   ordered by group and session rather than by verdict arrival (:func:`rows_by_run`: the
   two workers race, and the order would change the minibatches) — the outcome
   advantages for ``outcome``, the shaped ones for ``process`` — then publishes each
   run's new weights (``policy_version + 1``) for its proxy: the loops close;
5. ``demo-report/index.html``: first the two learning curves (mean outcome per update,
   a band over groups), the process-reward share of the advantage and a verdict
   computed from them; then statuses, latency (end -> verdict p50 / p99, per-stage),
   rewards per scorer, advantages, loss / ratio / version and token views. Beside it
   ``verdicts.jsonl``, ``trainer-log.jsonl``, ``learning-curves.json``,
   ``streaming.json`` and the judge's ``judge-audit.jsonl``.

Exit status 0 when every step ran, the trainer ended without an error, every verdict is
what the proxies expected, the workers exited cleanly, the first minibatch of every step
was on-policy (recomputed log-probs equal the behaviour log-probs to float noise),
the report's learning curves equal those read back from the verdicts and from the
trainer log (:func:`prm_pipeline.demo.curves.check_run`), and the trajectories topic,
read back from the broker, holds the records the proxies sent: ``turn`` and ``end``
records, no ``ready`` one (see :func:`_iterate`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from infra.config import PipelineConfig, PRMScorerConfig, load_config
from infra.kafka import ensure_topics
from infra.local import LOCAL_BROKER_CLIENT, LocalStack, free_port
from prm_pipeline.demo.curves import RUNS, check_run, curves_from_trainer_log, group_id, parse_group_id, verdict_text
from prm_pipeline.demo.processes import WorkerProcesses, write_config
from prm_pipeline.observe import VerdictTail
from producers.publisher import TrajectoryPublisher

if TYPE_CHECKING:  # the rollout proxy imports torch: the CLI imports this module to build its parser, without it
    from prm_pipeline.demo.fake_judge import FakeJudgeServer
    from prm_pipeline.demo.report import DemoRecord
    from prm_pipeline.demo.rollout_proxy import RolloutProxy

DEMO_GROUP_TIMEOUT_S = 6.0
ALIGNMENT_TOLERANCE = 1e-4  # the demo's alarm; the tests hold the alignment to 1e-5
JUDGE = "scoring_workers.scorers.openclaw.OpenClawJudgeScorer"
OPD = "scoring_workers.scorers.opd.OPDTeacherScorer"
AUDIT_SINK = "prm_pipeline.token_view:record_judge_audit"
JUDGE_WEIGHT = 0.5  # the judge's +1/-1 per answered turn, next to a GRPO advantage of about +-1
OPD_WEIGHT = 0.2  # teacher - policy log-prob on hinted (failed) turns: a small pull, nats are large
LEARNING_RATE = 1e-2  # Adam; a tiny model from scratch moves visibly within a dozen updates
DEFAULT_UPDATES = 12
TURNS = 3  # every session's main branch: 3 turns, so the outcome (all turns pass) is sparse


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
    """The demo's scorers (judge + OPD teacher), additive shaping, kept channels, both runs in one batch.

    The config file's own scorers are left out: its length budget would reward short
    answers, the opposite of what this task asks, and blur the comparison.
    """
    common = {"base_url": judge_url, "audit_sink": AUDIT_SINK, "temperature": 0.0, "timeout_s": 10.0}
    scorers = [
        PRMScorerConfig(path=JUDGE, weight=JUDGE_WEIGHT, kwargs={**common, "m": 3}),
        PRMScorerConfig(path=OPD, weight=OPD_WEIGHT, kwargs={**common, "m": 1, "teacher_base_url": teacher_url}),
    ]
    shaping = msgspec.structs.replace(cfg.prm.advantage_shaping, mode="additive")
    prm = msgspec.structs.replace(cfg.prm, scorers=scorers, advantage_shaping=shaping)
    agent = msgspec.structs.replace(cfg.rollout.agent, prm=prm)
    return msgspec.structs.replace(
        cfg,
        rollout=msgspec.structs.replace(cfg.rollout, agent=agent),
        # the judge's audit sink (record_judge_audit) is named in config, so it passes the allow-list
        worker=msgspec.structs.replace(
            cfg.worker,
            group_timeout_s=DEMO_GROUP_TIMEOUT_S,
            keep_scorer_channels=True,
            allowed_scorer_modules=[*cfg.worker.allowed_scorer_modules, AUDIT_SINK.split(":")[0]],
        ),
        trainer=msgspec.structs.replace(cfg.trainer, batch_groups=prompts * len(RUNS), device="cpu"),
    )


class ModelServerProcess:
    """``prm-pipeline model-server`` as a child process; :meth:`wait_url` once it listens."""

    def __init__(self, log_path: Path, seed: int = 0) -> None:
        self.log_path = log_path
        self.port = free_port()  # known up front, so the workers can start while the model loads
        self.proc = subprocess.Popen(  # the teacher: the runs' initial weights (the same seed)
            [sys.executable, "-m", "prm_pipeline.cli", "model-server", "--port", str(self.port), "--seed", str(seed)],
            stdout=subprocess.PIPE,
            stderr=log_path.open("wb"),
            text=True,
        )

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


def _rows(batch: Any, rows: list[int]) -> Any:
    """The sub-batch of ``rows`` (tensors, channels and per-row lists), for one run's update."""
    import torch

    index = torch.tensor(rows, dtype=torch.long)
    picked: dict[str, Any] = {name: getattr(batch, name)[index] for name in batch._TENSORS}
    picked["channels"] = {k: v[index] for k, v in batch.channels.items()}
    for name in ("group_ids", "session_ids", "trajectory_ids", "leaf_ids", "turn_results"):
        values = getattr(batch, name)
        picked[name] = [values[i] for i in rows] if values else values
    return dataclasses.replace(batch, **picked)


class _Run:
    """One run's policy copy (the trainer's), optimiser and weight store."""

    def __init__(self, name: str, store: Any, seed: int) -> None:
        from prm_pipeline.demo.policy_update import PolicyUpdate
        from prm_pipeline.demo.tiny_model import TinyLMConfig, TinyPolicy

        self.name = name
        self.policy = TinyPolicy.create(TinyLMConfig(seed=seed))  # the trainer's own copy
        self.updater = PolicyUpdate(self.policy.model, lr=LEARNING_RATE)
        self.store = store
        self.version = 0


class _Loop:
    """The trainer half of the closed loops: splits each batch by run, steps each run's model,
    publishes its weights, and logs what the report and the checks need."""

    def __init__(self, stores: dict[str, Any], seed: int, prompts: int) -> None:
        self.runs = {name: _Run(name, stores[name], seed) for name in RUNS}
        self.prompts = prompts
        self.done = asyncio.Event()
        self.records: list[dict[str, Any]] = []  # one per run and step
        self.log: list[dict[str, Any]] = []  # trainer-log.jsonl
        self.advantages: list[tuple[float, float]] = []  # (outcome, shaped) of the process run
        self.timings: list[dict[str, float]] = []  # per step: batch_in, trained (perf_counter), publish weights (s)
        self.rng = random.Random(seed)

    def __call__(self, batch: Any, shaped: Any) -> dict[str, float]:
        batch_in = time.perf_counter()
        step = len(self.timings) + 1
        publish_s = 0.0
        out: dict[str, float] = {}
        by_run = rows_by_run(batch, update=step - 1, prompts=self.prompts)
        for name, rows in by_run.items():
            run = self.runs[name]
            sub = _rows(batch, rows)
            mask = shaped.loss_mask[rows].bool()
            outcome_adv = shaped.outcome_advantages[rows]
            adv = outcome_adv if name == "outcome" else shaped.advantages[rows]
            process = (shaped.advantages[rows] - outcome_adv)[mask].abs()
            stats = run.updater.step(sub, adv, mask)
            run.version += 1
            t1 = time.perf_counter()
            run.store.publish(run.policy.model, run.version)
            publish_s += time.perf_counter() - t1
            groups: dict[str, dict[str, float]] = {}  # group -> session -> outcome (branch rows repeat it)
            for i in rows:
                groups.setdefault(batch.group_ids[i], {})[batch.session_ids[i]] = float(batch.rewards[i])
            outcome_abs = outcome_adv[mask].abs()
            used = adv[mask]
            # the process rewards' share of the advantage this run trained on (0 for the outcome run)
            share = (
                0.0
                if name == "outcome"
                else float(process.sum() / (process.sum() + outcome_abs.sum()).clamp_min(1e-12))
            )
            from shaper.shaping import shift_token_rewards

            per_scorer = (
                {
                    f"process_mean_abs/{k}": float(shift_token_rewards(v[rows])[mask].abs().mean())
                    for k, v in sorted(batch.channels.items())
                }
                if mask.any()
                else {}
            )
            line = {
                "step": step,
                "run": name,
                "policy_version": run.version - 1,
                "groups": {g: list(s.values()) for g, s in sorted(groups.items())},
                "mean_outcome": sum(sum(s.values()) / len(s) for s in groups.values()) / len(groups),
                "loss_tokens": int(mask.sum()),
                "nonzero_advantage_fraction": float((used != 0).float().mean()) if used.numel() else 0.0,
                "outcome_advantage_mean_abs": float(outcome_abs.mean()) if outcome_abs.numel() else 0.0,
                "process_mean_abs": float(process.mean()) if process.numel() else 0.0,
                "process_share": share,
                **per_scorer,
                **stats.as_dict(),
            }
            self.log.append(line)
            self.records.append(
                {
                    "step": float(step),
                    "run": name,
                    "policy_version": float(run.version),
                    "rows": float(len(rows)),
                    "mean_outcome": line["mean_outcome"],
                    "process_share": share,
                    **stats.as_dict(),
                }
            )
            out.update({f"{name}/{k}": v for k, v in stats.as_dict().items()})
            if name == "process":
                pairs = list(zip(outcome_adv[mask].tolist(), shaped.advantages[rows][mask].tolist()))
                self.advantages += self.rng.sample(pairs, min(len(pairs), 300))
        self.timings.append({"batch_in": batch_in, "trained": time.perf_counter(), "publish weights": publish_s})
        self.done.set()
        return out


def rows_by_run(batch: Any, *, update: int, prompts: int) -> dict[str, list[int]]:
    """Each run's rows of ``batch``, in an order that does not depend on when verdicts arrived.

    The trainer's consumer collates groups in the order their verdicts reached it, and
    two workers race to publish them; rows in arrival order would change the PPO
    minibatches (and so the weights) from one run of a seed to the next. Rows are
    ordered by group, session, trajectory and leaf instead. The batch must hold exactly
    the ``prompts`` groups of every run sampled for ``update`` (0-based), nothing else.
    """
    want = {group_id(name, update, k) for name in RUNS for k in range(prompts)}
    got = set(batch.group_ids)
    if got != want:
        raise RuntimeError(
            f"update {update + 1}: the batch holds groups {sorted(got - want)} it should not and "
            f"lacks {sorted(want - got)}"
        )

    def key(i: int) -> tuple[str, ...]:
        return tuple(
            str(getattr(batch, name)[i]) if getattr(batch, name) else ""
            for name in ("group_ids", "session_ids", "trajectory_ids", "leaf_ids")
        )

    order = sorted(range(len(batch.group_ids)), key=key)
    return {name: [i for i in order if batch.group_ids[i].startswith(f"{name}-")] for name in RUNS}


@dataclasses.dataclass
class _Demo:
    """What the demo's start-up left running, for the iterations, the shut-down and the report."""

    cfg: PipelineConfig  # the demo's (demo_config): its scorers, shaping and batch size
    prompts: int
    group_size: int
    audit_path: Path  # the workers' judge audit sink writes here
    teacher_url: str
    server: ModelServerProcess
    judge: FakeJudgeServer
    procs: WorkerProcesses
    proxies: dict[str, RolloutProxy]
    loop: _Loop
    tail: VerdictTail
    stage_setup: dict[str, float]  # "model-server ready", "start-up": seconds after the start


async def _start(cfg: PipelineConfig, workdir: Path, *, prompts: int, group_size: int, seed: int) -> _Demo:
    """Start the judge, the model server, the topics, both workers and both runs' proxies, and wait for them.

    The workers start while the model server loads (its port is known up front); a
    discarded warm-up group whose verdict comes back proves the workers consume, so the
    first iteration's scoring time is not start-up time.
    """
    import torch

    from prm_pipeline.demo.fake_judge import FakeJudgeServer
    from prm_pipeline.demo.rollout_proxy import RolloutConfig, RolloutProxy
    from prm_pipeline.demo.tiny_model import TinyLMConfig, TinyPolicy, WeightStore
    from prm_pipeline.token_view import AUDIT_ENV

    torch.set_num_threads(1)  # two shared cores: one thread each for the proxy and the trainer
    t_start = time.perf_counter()
    stage_setup: dict[str, float] = {}
    audit_path = workdir / "judge-audit.jsonl"
    os.environ[AUDIT_ENV] = str(audit_path)  # inherited by the workers (their judge audit sink)
    server = ModelServerProcess(workdir / "model-server.log", seed)
    judge = FakeJudgeServer()
    judge.start()
    created = await ensure_topics(cfg.kafka, cfg.topics)
    print(f"topics: {', '.join(f'{n} ({s.state})' for n, s in created.items())}")
    teacher_url = f"http://127.0.0.1:{server.port}"
    cfg = demo_config(cfg, judge_url=judge.base_url, teacher_url=teacher_url, prompts=prompts)
    procs = WorkerProcesses(write_config(cfg, workdir / "config.yaml"), workdir, n=2)
    procs.start()
    stores = {name: WeightStore(workdir / f"weights-{name}") for name in RUNS}
    proxies = {}
    for name in RUNS:  # the same seed: the same initial weights and the same first rollouts
        policy = TinyPolicy.create(TinyLMConfig(seed=seed))
        stores[name].publish(policy.model, 0)
        proxies[name] = RolloutProxy(
            policy,
            RolloutConfig(group_size=group_size, seed=seed, min_turns=TURNS, max_turns=TURNS),
            store=stores[name],
        )
    loop = _Loop(stores, seed, prompts)
    if await asyncio.wait_for(asyncio.to_thread(server.wait_url), timeout=120) != teacher_url:
        raise RuntimeError(f"model-server is not listening on {teacher_url}; see {server.log_path}")
    stage_setup["model-server ready"] = time.perf_counter() - t_start
    n_params = sum(p.numel() for p in policy.model.parameters())
    print(
        f"tiny LM: Llama 2 layers, hidden 64, {n_params:,} parameters, vocab {policy.tokenizer.get_vocab_size()}; "
        f"teacher {teacher_url}; scripted judge {judge.base_url}"
    )
    print(
        "scorers: "
        + ", ".join(f"{s.path.rsplit('.', 1)[-1]}(weight={s.weight})" for s in cfg.prm.scorers)
        + f"; runs: {' vs '.join(RUNS.values())} (shaping {cfg.prm.advantage_shaping.mode}), seed {seed}"
    )
    tail = VerdictTail(cfg)
    await tail.start()
    async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
        await pub.discard_group("demo-warmup", "warm-up probe")
    await _await_verdicts(tail, procs, {"demo-warmup"}, timeout_s=60)
    stage_setup["start-up"] = time.perf_counter() - t_start
    print(
        f"started 2 scoring workers and the model server in {stage_setup['start-up']:.1f}s (model server "
        f"ready after {stage_setup['model-server ready']:.1f}s; logs in {workdir})"
    )
    return _Demo(
        cfg=cfg,
        prompts=prompts,
        group_size=group_size,
        audit_path=audit_path,
        teacher_url=teacher_url,
        server=server,
        judge=judge,
        procs=procs,
        proxies=proxies,
        loop=loop,
        tail=tail,
        stage_setup=stage_setup,
    )


async def _iterate(
    demo: _Demo,
    it: int,
    pub: TrajectoryPublisher,
    trainer: asyncio.Task[Any],
    expect: dict[str, tuple[str, str]],
    record: DemoRecord,
) -> None:
    """One iteration of both loops: sample and publish, wait for the verdicts and the trainer's step, print it.

    Besides the runs' groups it publishes what the workers must turn away (a discarded
    group every iteration; in the first, a group whose last member never arrives and one
    that is not concat export) and notes in ``expect`` the status each group must get.
    """
    from prm_pipeline.demo.report import IterationMarks, iteration_stages

    proxies, loop, tail = demo.proxies, demo.loop, demo.tail
    start = time.perf_counter()
    for proxy in proxies.values():
        proxy.reload()
    reloaded = time.perf_counter()
    loop.done.clear()  # before the first turn goes out: the step may come while the rest is sampled
    groups = [  # streamed: every turn goes out as it is sampled, the workers judge it meanwhile
        await proxies[name].stream_group(pub, group_id(name, it, k)) for name in RUNS for k in range(demo.prompts)
    ]
    first = proxies["outcome"]
    # sampled in a worker thread, as the runs' sessions are: the verdict tail keeps stamping arrivals meanwhile
    lost, broken = await asyncio.to_thread(_turned_away, first, demo.group_size) if it == 0 else ([], [])
    sampled = time.perf_counter()
    expect.update({g[0].group_id: ("accepted", "") for g in groups})
    await pub.discard_group(f"it{it}-filtered", "prompt filtered by the proxy")
    expect[f"it{it}-filtered"] = ("discarded", "discarded")
    if lost:  # rejected at the group deadline
        # streamed too: either worker's sweeper may decide it, reading members back from the log
        await first.publish(pub, lost)
        expect["it0-lost"] = ("rejected", "missing_sessions")
    if broken:  # a member whose last turn was re-templated: refused by the workers
        await first.publish(pub, broken)
        expect["it0-broken"] = ("rejected", "not_concat_export")
    await pub.flush()
    published = time.perf_counter()
    accepted = {g[0].group_id for g in groups}
    await _await_verdicts(tail, demo.procs, accepted, timeout_s=120)
    ended = {sid: t for proxy in proxies.values() for sid, t in proxy.stats.ended.items()}
    record.end_to_verdict += [tail.arrivals[m.group_id] - ended[m.session_id] for g in groups for m in g]
    record.group_end_to_verdict += [tail.arrivals[g[0].group_id] - max(ended[m.session_id] for m in g) for g in groups]
    await _wait_step(loop.done, trainer)
    timing = loop.timings[-1]
    stage = iteration_stages(
        IterationMarks(
            start=start,
            reloaded=reloaded,
            sampled=sampled,
            published=published,
            last_verdict=max(tail.arrivals[g] for g in accepted),
            batch_in=timing["batch_in"],
            trained=timing["trained"],
            publish_weights_s=timing["publish weights"],
            seen=time.perf_counter(),
        )
    )
    record.stages.append(stage)
    last = {r["run"]: r for r in loop.records[-len(RUNS) :]}
    n_turns = sum(len(m.interactions) for g in groups for m in g)
    print(
        f"  iter {it}: {len(groups)} groups ({n_turns} turns) sampled and streamed in {stage['rollout']:.2f}s, "
        f"last verdict {stage['scoring (publish -> verdicts)']:.2f}s after the last record; "
        f"step {it + 1}: mean outcome "
        + ", ".join(f"{label} {last[name]['mean_outcome']:.2f}" for name, label in RUNS.items())
        + f"; process share {last['process']['process_share']:.2f}; align |d|max "
        f"{max(r['update/alignment_max_abs_diff'] for r in last.values()):.1e}"
    )


async def _shut_down(
    demo: _Demo, trainer: asyncio.Task[Any], stop_trainer: asyncio.Event
) -> tuple[bool, list[int | None]]:
    """Stop the tail, the trainer (gracefully first), the workers, the model server and the judge.

    Runs however the iterations ended. Returns whether the trainer ended without an
    error (a cancelled one counts as clean) and the workers' exit codes.
    """
    await demo.tail.aclose()
    stop_trainer.set()  # graceful: the consumer commits and leaves its group
    done, _ = await asyncio.wait([trainer], timeout=30)
    if not done:
        trainer.cancel()
    summary = await asyncio.gather(trainer, return_exceptions=True)
    trainer_ok = True
    if isinstance(summary[0], BaseException) and not isinstance(summary[0], asyncio.CancelledError):
        print(f"  trainer failed: {summary[0]!r}")
        trainer_ok = False
    codes = demo.procs.stop()
    demo.server.stop()
    demo.judge.stop()
    return trainer_ok, codes


async def _run(
    cfg: PipelineConfig, workdir: Path, out_dir: Path, *, updates: int, prompts: int, group_size: int, seed: int
) -> int:
    """The whole demo: start-up, ``updates`` iterations of both loops, shut-down, then checks and report."""
    from prm_pipeline.demo.report import DemoRecord
    from shaper.trainer import run_trainer

    demo = await _start(cfg, workdir, prompts=prompts, group_size=group_size, seed=seed)
    cfg, loop, tail = demo.cfg, demo.loop, demo.tail
    stop_trainer = asyncio.Event()
    trainer = asyncio.create_task(run_trainer(cfg, update=loop, batch_groups=prompts * len(RUNS), stop=stop_trainer))
    expect: dict[str, tuple[str, str]] = {}  # group -> (status, reason code)
    record = DemoRecord()
    t0 = time.perf_counter()
    try:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            for it in range(updates):
                await _iterate(demo, it, pub, trainer, expect, record)
            for proxy in demo.proxies.values():
                proxy.reload()
            print(
                "  proxies reloaded policy "
                + ", ".join(f"{n} v{p.policy.version}" for n, p in demo.proxies.items())
                + f" (published after step {len(loop.timings)})"
            )
        await tail.wait_for(set(expect), timeout_s=DEMO_GROUP_TIMEOUT_S + 60)
        teacher_requests = _teacher_requests(demo.teacher_url)
        record.topic_records = await _topic_records(cfg)
    finally:
        trainer_ok, codes = await _shut_down(demo, trainer, stop_trainer)
    loop_s = time.perf_counter() - t0
    return _check_and_report(
        demo,
        record,
        out_dir,
        expect=expect,
        t0=t0,
        loop_s=loop_s,
        codes=codes,
        teacher_requests=teacher_requests,
        trainer_ok=trainer_ok,
        updates=updates,
        streaming=_streaming_problems(record.topic_records, pub.published),
    )


def _check_and_report(
    demo: _Demo,
    record: DemoRecord,
    out_dir: Path,
    *,
    expect: dict[str, tuple[str, str]],
    t0: float,
    loop_s: float,
    codes: list[int | None],
    teacher_requests: int,
    trainer_ok: bool,
    updates: int,
    streaming: list[str],
) -> int:
    """Write the report and the files beside it, print the summary and every failed check; the exit status.

    The checks: every expected group got its status, the workers exited 0, every step
    ran and was on-policy, the report's curves are the verdicts' and the trainer log's,
    and the trajectories topic holds the records the proxies published: the runs' sessions
    streamed (``streaming``: what is wrong there).
    """
    from prm_pipeline.demo.report import write_report

    loop, tail, stage_setup = demo.loop, demo.tail, demo.stage_setup
    verdicts = {g: v for g, v in tail.verdicts.items() if g in expect}
    statuses = collections.Counter(v.status for v in verdicts.values())
    wrong = {
        g: (want, verdicts[g].status, verdicts[g].reason)
        for g, want in expect.items()
        if (verdicts[g].status, verdicts[g].reason_code) != want
    }
    worst = max(s["update/alignment_max_abs_diff"] for s in loop.records)
    _record_run(demo, record, out_dir, verdicts, t0=t0)
    record.summary = [
        record.learning_verdict,
        f"{len(loop.timings)} updates of each run in {loop_s:.1f}s (start-up {stage_setup['start-up']:.1f}s, the "
        f"model server ready after {stage_setup['model-server ready']:.1f}s); policy versions "
        + ", ".join(f"{n} v{p.policy.version}" for n, p in demo.proxies.items())
        + " at the end",
        f"verdicts: {dict(statuses)}; scripted-judge requests {demo.judge.requests}, teacher (model-server) "
        f"requests {teacher_requests}",
        f"alignment: max |recomputed - behaviour| log-prob on the first minibatch of each step = {worst:.2e}",
        _streaming_line(record),
        f"workers exited with {codes}",
    ]
    path = write_report(record, out_dir)
    mismatches = check_run(out_dir)
    print()
    print("summary")
    for line in record.summary:
        print(f"  {line}")
    if wrong:
        print(f"  UNEXPECTED verdicts: {dict(list(wrong.items())[:10])}")
    if worst > ALIGNMENT_TOLERANCE:
        print(f"  ALIGNMENT: recomputed log-probs differ from the behaviour log-probs by {worst:.2e}")
    for line in mismatches:
        print(f"  LEARNING CURVES: {line}")
    for line in streaming:
        print(f"  STREAMING: {line}")
    ok = (
        trainer_ok
        and not wrong
        and codes == [0, 0]
        and len(loop.timings) == updates
        and worst <= ALIGNMENT_TOLERANCE
        and not mismatches
        and not streaming
    )
    print("demo OK" if ok else "demo FAILED")
    print(f"report: {path.resolve()}")
    return 0 if ok else 1


async def _topic_records(cfg: PipelineConfig) -> dict[str, int]:
    """The trajectories topic's records by kind (``turn``, ``end``, ``discard``, ...), read back from the broker."""
    from infra.schema import ALL_KINDS, decode_message, kind_of
    from prm_pipeline.audit.replay import read_snapshot

    kinds: collections.Counter[str] = collections.Counter()
    async for r in read_snapshot(cfg, cfg.topics.trajectories):
        if r is not None:
            kinds[kind_of(decode_message(r.value, r.headers, expand=False, kinds=ALL_KINDS))] += 1
    return dict(sorted(kinds.items()))


def _streaming_problems(topic: dict[str, int], published: dict[str, int]) -> list[str]:
    """Why the topic does not hold exactly the records the proxies published, every session
    streamed (none: it does)."""
    problems = [
        f"{topic.get(kind, 0)} {kind} record(s) on the topic, the proxies published {published[kind]}"
        for kind in ("turn", "end", "ready")
        if topic.get(kind, 0) != published[kind]
    ]
    if not published["end"]:
        problems.append("no session was streamed")
    if published["ready"]:
        problems.append(f"{published['ready']} session(s) went out whole, not streamed")
    return problems


def _streaming_line(record: DemoRecord) -> str:
    """The summary's line on streaming: the topic's records and the end -> verdict latency."""
    from prm_pipeline.demo.report import end_to_verdict

    sessions, groups = end_to_verdict(record)
    return (
        "streamed sessions: the trajectories topic holds "
        + ", ".join(f"{n} {kind}" for kind, n in record.topic_records.items())
        + f" records; end -> verdict over {sessions['n']} sessions p50 {sessions['p50 (s)']:.3f}s, "
        f"p99 {sessions['p99 (s)']:.3f}s (from each group's last end, over {groups['n']} groups: p50 "
        f"{groups['p50 (s)']:.3f}s, p99 {groups['p99 (s)']:.3f}s)"
    )


def _record_run(demo: _Demo, record: DemoRecord, out_dir: Path, verdicts: dict[str, Any], *, t0: float) -> None:
    """Fill ``record`` with what the report draws, and write the raw files the checks re-read beside it.

    ``verdicts.jsonl`` and ``trainer-log.jsonl`` are what :func:`check_run` recomputes the
    learning curves from; ``judge-audit.jsonl`` (when the judge wrote one) backs the token views.
    """
    from prm_pipeline.token_view import branch_views, demo_decoder, load_audit, render_html, verdict_record

    loop = demo.loop
    record.verdict_events = [(demo.tail.arrivals[g] - t0, g, v.status) for g, v in verdicts.items()]
    record.steps = loop.records
    record.advantages = loop.advantages
    for v in verdicts.values():
        for s in v.sessions:
            for tr in s.turn_results:
                record.scorer_turn_rewards.setdefault(tr.scorer_name, []).append(tr.reward)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [verdict_record(v) for v in verdicts.values()]
    (out_dir / "verdicts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out_dir / "trainer-log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in loop.log))
    if demo.audit_path.exists():
        (out_dir / "judge-audit.jsonl").write_bytes(demo.audit_path.read_bytes())
    record.token_views_html = render_html(
        _sample_views(records, load_audit(demo.audit_path), branch_views), demo_decoder()
    )
    record.curves = curves_from_trainer_log(loop.log)
    record.process_share = [line["process_share"] for line in loop.log if line["run"] == "process"]
    record.learning_verdict = verdict_text(record.curves, record.process_share)


def _turned_away(first: RolloutProxy, group_size: int) -> tuple[list[Any], list[Any]]:
    """The first iteration's groups the workers must reject, sampled whole: one whose last
    member never arrives (left out here), and one with a member that is not concat export."""
    lost = first.group("it0-lost")[:-1]
    broken = [first.session("it0-broken", i, "compute 1 + 1", turns=2, branch=False) for i in range(group_size)]
    return lost, _not_concat(broken)


def _not_concat(members: list[Any]) -> list[Any]:
    """The group with its last member's last turn (not a root) changed inside its history: not concat export."""
    from infra.schema import Interaction, ModelResponse

    last = members[-1]
    turn = last.interactions[-1]
    mr = turn.model_response
    tokens = mr.input_tokens.copy()
    tokens[0] += 1  # the parent produced this prefix; a re-applied template would change it like this
    bad = Interaction(
        interaction_id=turn.interaction_id,
        parent_id=turn.parent_id,
        messages=turn.messages,
        output_message_list=turn.output_message_list,
        model_response=ModelResponse.from_arrays(tokens, mr.output_tokens, mr.output_logprobs, mr.stop_reason),
    )
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
    """How many requests the model server (the OPD teacher) answered, from its ``/health``."""
    import httpx

    return int(httpx.get(f"{url}/health", timeout=5).json().get("requests", 0))


def _sample_views(records: list[dict[str, Any]], audit: Any, branch_views: Any) -> list[Any]:
    """Sessions of the process run's last iteration: a branching one and a plain multi-turn one."""
    views = [v for r in records if r["status"] == "accepted" for v in branch_views(r, audit)]
    its = [p[1] for v in views if (p := parse_group_id(v.group_id)) is not None and p[0] == "process"]
    last = group_id("process", max(its), 0).rsplit("-", 1)[0] if its else ""
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
        with LocalStack(
            Path(tmp) / "stack", broker_binary=cfg.local.broker_binary, redis_binary=cfg.local.redis_binary
        ) as stack:
            print(f"embedded stack: kafka {stack.kafka_bootstrap}, redis {stack.redis_url}")
            cfg = msgspec.structs.replace(
                cfg,
                kafka=msgspec.structs.replace(
                    cfg.kafka,
                    bootstrap=stack.kafka_bootstrap,
                    **{**LOCAL_BROKER_CLIENT, "session_timeout_ms": 3000, "heartbeat_interval_ms": 1000},
                ),
                redis=msgspec.structs.replace(cfg.redis, url=stack.redis_url),
            )
            workdir = Path(tmp) / "workers"
            workdir.mkdir()
            return asyncio.run(
                _run(
                    cfg,
                    workdir,
                    out_dir,
                    updates=args.updates,
                    prompts=args.prompts,
                    group_size=args.group_size,
                    seed=args.seed,
                )
            )


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from prm_pipeline.cli import positive_int

    p.add_argument(
        "--updates",
        type=positive_int,
        default=DEFAULT_UPDATES,
        help=f"policy updates of each run (default {DEFAULT_UPDATES}); more runs longer",
    )
    p.add_argument("--prompts", type=positive_int, default=4, help="GRPO groups per update and run (default 4)")
    p.add_argument("--group-size", type=positive_int, default=4, help="sessions per group (default 4)")
    p.add_argument("--seed", type=int, default=0, help="one seed for both runs: weights, prompts, sampling")
    p.add_argument("--out", default="demo-report", help="report directory (default demo-report)")
