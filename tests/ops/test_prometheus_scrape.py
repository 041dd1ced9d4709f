"""A real Prometheus (Debian's ``prometheus``, installed by ``make test-ops``) on loopback
scrapes the embedded stack: two worker processes (with an LLM judge scorer against the
fake judge), the trainer's consumer (in this process) and ``prm-pipeline status --watch
--metrics-port``, while groups flow: accepted ones, stale ones the trainer drops, a
discarded group and an undecodable record (a dead letter and a rejected group).

Then every alert rule loads and evaluates without error, every alert's query and every
dashboard query returns series carrying the labels its annotations and legends use, and
every metric named in README.md and docs/ exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis as redis_sync
import yaml

from infra.config import PipelineConfig, PRMScorerConfig, TrainerConfig
from infra.kafka import ensure_topics, make_producer
from infra.local import free_port
from infra.monitoring.__main__ import RULES
from infra.monitoring.alerts import ALERTS
from infra.monitoring.dashboard import PANELS
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from prm_pipeline.demo.processes import write_config
from producers.publisher import TrajectoryPublisher
from shaper.trainer import run_trainer
from tests.integration.harness import isolated_config
from tests.integration.test_judge_pipeline import judged_trajectory
from tests.polling import poll_until, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
DEADLINE_S = 120.0
TRAINER_VERSION = 5  # the trainer's policy; groups rolled out by v0 are more than max_policy_lag=1 behind


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


def query(port: int, expr: str) -> list[dict[str, Any]]:
    return api(port, "query", query=expr)["result"]


@contextlib.contextmanager
def prometheus(tmp: Path, targets: dict[str, list[int]]) -> Iterator[int]:
    assert PROMETHEUS, "prometheus missing: run `make test-ops` (it installs the Debian package prometheus)"
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
            for job, ports in targets.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def ready() -> bool:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).close()
            except OSError:
                return False
            return True

        wait_until(ready, timeout_s=60, interval_s=0.2, what="prometheus to become ready")
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "prm_pipeline.cli", *args],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )


def doc_metric_names() -> set[str]:
    texts = [(ROOT / "README.md").read_text()] + [p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))]
    return {m for t in texts for m in re.findall(r"\bprm_(?:worker|trainer|pipeline|judge)_[a-z0-9_]*[a-z0-9]\b", t)}


@pytest.fixture
def redis_with_maxmemory(redis_url: str) -> Iterator[None]:
    """maxmemory on the test Redis (restored after): the memory alert divides by it."""
    client = redis_sync.Redis.from_url(redis_url)
    before = client.config_get("maxmemory")["maxmemory"]
    client.config_set("maxmemory", str(8 << 30))
    try:
        yield
    finally:
        client.config_set("maxmemory", before)
        client.close()


async def feed(cfg: PipelineConfig, stop: asyncio.Event) -> None:
    """Every half second: a fresh group, a stale group, a discard and an undecodable record."""
    producer = make_producer(cfg.kafka)
    await producer.start()
    try:
        async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
            i = 0
            while not stop.is_set() and i < 200:
                for version in (TRAINER_VERSION, 0):
                    gid = f"v{version}-{i}-{uuid.uuid4().hex[:4]}"
                    for m in range(2):
                        traj = judged_trajectory(gid, f"{gid}-s{m}", 2, [("tool", "ok, success")], outcome=float(m))
                        await pub.publish_ready(msgspec.structs.replace(traj, policy_version=version))
                await pub.discard_group(f"dropped-{i}", reason="policy")
                await producer.send_and_wait(cfg.topics.trajectories, b"\x00not a trajectory", key=f"bad-{i}".encode())
                i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        await producer.stop()


def missing_labels(result: list[dict[str, Any]], labels: tuple[str, ...]) -> list[dict[str, str]]:
    return [s["metric"] for s in result if not set(labels) <= set(s["metric"])]


async def test_real_prometheus_scrapes_the_pipeline(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path: Path, redis_with_maxmemory: None
) -> None:
    judge = FakeJudgeServer()
    judge.start()
    scorer = PRMScorerConfig(
        "scoring_workers.scorers.openclaw.OpenClawJudgeScorer",
        kwargs={
            "base_url": judge.base_url,
            "model": "fake-judge",
            "temperature": 0.0,
            "max_tokens": 64,
            "m": 1,
            "timeout_s": 5.0,
            "total_timeout_s": 10.0,
        },
    )
    cfg = isolated_config(
        unique_name, kafka_bootstrap, redis_url, scorers=[scorer], scorer_timeout_s=15, group_timeout_s=60
    )
    cfg = msgspec.structs.replace(
        cfg, trainer=TrainerConfig(group_id=f"trainer.{unique_name}", max_policy_lag=1, device="cpu")
    )
    config = write_config(cfg, tmp_path / "config.yaml")
    await ensure_topics(cfg.kafka, cfg.topics)
    worker_ports, status_port, trainer_port = [free_port(), free_port()], free_port(), free_port()
    procs = [
        spawn(
            ["--config", str(config), "worker", "--worker-id", f"w{i}", "--metrics-port", str(p)],
            tmp_path / f"worker{i}.log",
        )
        for i, p in enumerate(worker_ports)
    ]
    procs.append(
        spawn(
            [
                "--config",
                str(config),
                "status",
                "--watch",
                "1",
                "--metrics-port",
                str(status_port),
                "--read-timeout",
                "5",
                "--json",
            ],
            tmp_path / "status.log",
        )
    )
    stop_feed, stop_trainer = asyncio.Event(), asyncio.Event()
    trainer = asyncio.create_task(
        run_trainer(cfg, batch_groups=1, policy_version=TRAINER_VERSION, metrics_port=trainer_port, stop=stop_trainer)
    )
    feeder = asyncio.create_task(feed(cfg, stop_feed))
    try:
        with prometheus(
            tmp_path, {"workers": worker_ports, "trainer": [trainer_port], "status": [status_port]}
        ) as prom:
            checks: dict[str, tuple[str, tuple[str, ...]]] = {f"alert {a.name}": (a.query, a.labels) for a in ALERTS}
            checks |= {f"panel '{p.title}' {q.legend}": (q.expr, q.labels) for p in PANELS for q in p.queries}
            pending = dict(checks)

            async def all_answered() -> bool:
                for name, (expr, _) in list(pending.items()):
                    if await asyncio.to_thread(query, prom, expr):
                        del pending[name]
                return not pending

            await poll_until(all_answered, timeout_s=DEADLINE_S, interval_s=1.0)
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(tmp_path.glob("*.log"))
            )
            assert not pending, f"no data from Prometheus for {sorted(pending)}\n{logs}"
            for name, (expr, labels) in checks.items():
                result = await asyncio.to_thread(query, prom, expr)
                assert result and not missing_labels(result, labels), f"{name}: {expr} -> {result[:3]} lacks {labels}"

            # the rules load and evaluate without error
            groups = (await asyncio.to_thread(api, prom, "rules"))["groups"]
            rules = {r["name"]: r for g in groups for r in g["rules"]}
            assert set(rules) == {a.name for a in ALERTS}

            async def current_rules() -> dict[str, dict]:
                return {
                    r["name"]: r for g in (await asyncio.to_thread(api, prom, "rules"))["groups"] for r in g["rules"]
                }

            rules = (
                await poll_until(
                    current_rules,
                    accept=lambda rules: all(r.get("health") == "ok" for r in rules.values()),
                    timeout_s=30,
                    interval_s=1.0,
                )
            ).last
            assert {n: r.get("lastError") for n, r in rules.items() if r.get("health") != "ok"} == {}

            # what the checks above saw is what happened
            stale = await asyncio.to_thread(query, prom, 'prm_trainer_pipeline_total{counter="filter/stale"}')
            assert stale and float(stale[0]["value"][1]) > 0
            dead = await asyncio.to_thread(query, prom, "sum(prm_worker_dead_lettered_total)")
            assert dead and float(dead[0]["value"][1]) > 0
            alive = await asyncio.to_thread(query, prom, "prm_pipeline_workers_alive")
            assert float(alive[0]["value"][1]) == 2

            # every metric the docs name exists (metadata covers labelled metrics not yet incremented)
            names = set(await asyncio.to_thread(api, prom, "label/__name__/values"))
            metadata = set(await asyncio.to_thread(api, prom, "metadata"))
            known = names | metadata
            missing = sorted(
                n for n in doc_metric_names() if not known & {n, f"{n}_total", f"{n}_bucket", n.removesuffix("_total")}
            )
            assert not missing, f"metrics named in the docs that no target exports: {missing}"
    finally:
        stop_feed.set()
        stop_trainer.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(feeder, 30)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(trainer, 30)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        judge.stop()
