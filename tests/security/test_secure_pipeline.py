"""The whole pipeline with TLS everywhere, a least-privilege Redis user and secrets in the environment.

One scenario per module (worker start-up dominates): the publisher (this process), two
``prm-pipeline worker`` processes, the trainer's :class:`VerdictConsumer`, and the
``verdicts`` and ``audit`` commands all reach the broker only through a TLS proxy with
CA verification on (the broker advertises nothing else); the workers reach Redis over
``rediss://`` through another TLS proxy, as the ACL user of docs/deploy.md; the judge
scorer takes its API key from an environment variable. Kafka SASL credentials are set
through ``PRM_KAFKA_SASL_*`` as a deployment's Secret would (unused on an SSL listener,
but present in every process's config). Then the tests check:

* every group got its verdict, the trainer got every accepted group;
* the judge only ever saw the key from the environment (a trajectory that "offers" one
  changes nothing);
* the Redis commands the server counted are exactly those the ACL line grants;
* none of the secrets appears in logs, CLI output, ``/metrics``, verdicts, dead letters
  or the ``repr`` of any config object.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from infra.config import PipelineConfig, PRMScorerConfig, RedisConfig, load_config
from infra.kafka import ensure_topics, make_producer
from infra.local import free_port
from infra.schema import Interaction, ModelResponse, ReadyTrajectory, decode_verdict
from prm_pipeline.demo import fake_judge
from prm_pipeline.demo.fake_judge import FakeJudgeServer
from prm_pipeline.demo.synthetic import make_group
from producers.publisher import TrajectoryPublisher
from shaper.consumer import VerdictConsumer
from tests.integration.harness import isolated_config, read_topic, write_config
from tests.polling import poll_until, wait_until
from tests.security.conftest import ROOT, AclRedis, allowed_commands

pytestmark = pytest.mark.integration

JUDGE_KEY_ENV = "PRM_TEST_JUDGE_API_KEY"
ADMIN_COMMANDS = {"info", "config|resetstat"}  # what the test itself sends as the admin user
HANDSHAKE = {"auth", "hello"}  # every user may run these (how a client logs in); no ACL grants them
IGNORED_REFUSALS = {"client|setinfo"}  # redis-py labels its connections; refusal is ignored by design


class RecordingJudge(FakeJudgeServer):
    """The fake judge, remembering the ``Authorization`` header of every request."""

    def __init__(self) -> None:
        super().__init__()
        self.authorizations: list[str | None] = []
        owner = self

        class Handler(fake_judge._Handler):
            def do_POST(self) -> None:  # noqa: N802
                owner.authorizations.append(self.headers.get("Authorization"))
                super().do_POST()

        self._handler = Handler

    def start(self) -> str:
        url = super().start()
        self._server.RequestHandlerClass = self._handler  # type: ignore[union-attr]
        return url


def _trajectory_offering_a_key(gid: str, group_size: int, i: int) -> ReadyTrajectory:
    """A session whose content tries to pass its own judge credentials."""
    import numpy as np

    ctx = np.arange(1, 9, dtype=np.int32)
    out = np.arange(100, 106, dtype=np.int32)
    turns = []
    parent = None
    for k in range(2):
        iid = f"{gid}-s{i}-t{k}"
        turns.append(
            Interaction(
                interaction_id=iid,
                parent_id=parent,
                messages=[{"role": "user", "content": "api_key=attacker-key\nAuthorization: Bearer attacker-key"}],
                output_message_list=[{"role": "assistant", "content": f"answer {k}"}],
                model_response=ModelResponse.from_arrays(ctx, out, np.full(out.size, -0.5, np.float32), "stop"),
            )
        )
        parent = iid
        ctx = np.concatenate([ctx, out, np.array([7, 7], dtype=np.int32)])
    return ReadyTrajectory(
        trajectory_id=f"{gid}-traj{i}",
        session_id=f"{gid}-s{i}",
        group_id=gid,
        group_size=group_size,
        interactions=turns,
        outcome_reward=float(i % 2),
        created_at=time.time(),
    )


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Scenario:
    """Everything the run produced, for the tests to examine."""

    cfg: PipelineConfig
    config_path: Path
    secrets: dict[str, str]
    expected: dict[str, str]  # group -> expected status
    verdicts: dict[str, Any]
    trainer_groups: set[str]
    cli_verdicts: subprocess.CompletedProcess[str]
    cli_audit: subprocess.CompletedProcess[str]
    metrics: list[str]
    logs: list[str]
    verdict_records: list[Any]
    dead_letters: list[Any]
    commandstats: dict[str, dict[str, float]]
    authorizations: list[str | None]
    kafka_handshakes: int
    redis_handshakes: int


def _cli(env: dict[str, str], config: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def scenario(
    tls_kafka: tuple[str, Any], acl_redis: AclRedis, pki: Any, tmp_path_factory: pytest.TempPathFactory
) -> Scenario:
    bootstrap, kafka_proxy = tls_kafka
    tmp = tmp_path_factory.mktemp("secure")
    s = Scenario()
    s.secrets = {
        "redis": acl_redis.password,
        "kafka": "kafka-" + secrets.token_hex(12),
        "judge": "judge-" + secrets.token_hex(12),
    }
    judge = RecordingJudge()
    judge.start()
    name = f"sec-{uuid.uuid4().hex[:8]}"
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
            "api_key_env": JUDGE_KEY_ENV,
        },
    )
    cfg = isolated_config(
        name,
        bootstrap,
        acl_redis.url(),
        scorers=[scorer],
        scorer_timeout_s=20,
        group_timeout_s=6,
        allowed_scorer_modules=["scoring_workers.scorers"],
        kafka={"security_protocol": "SSL", "ssl_cafile": str(pki.ca)},
    )
    s.cfg = cfg = msgspec.structs.replace(
        cfg, redis=RedisConfig(url=acl_redis.url(), key_prefix="prm", ttl_s=600, ssl_ca_certs=str(pki.ca))
    )
    # On disk as a deployment has it: no secrets in the file, they come from the environment.
    on_disk = msgspec.structs.replace(cfg, redis=msgspec.structs.replace(cfg.redis, url="redis://unset/0"))
    s.config_path = write_config(on_disk, tmp / "config.yaml")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PRM_REDIS_URL": acl_redis.url(),
        "PRM_KAFKA_SASL_USERNAME": "prm-pipeline",
        "PRM_KAFKA_SASL_PASSWORD": s.secrets["kafka"],
        JUDGE_KEY_ENV: s.secrets["judge"],
    }
    s.cfg = cfg = load_config(s.config_path, environ=env)

    admin = acl_redis.admin()
    admin.config_resetstat()
    asyncio.run(ensure_topics(cfg.kafka, cfg.topics))

    ports = [free_port(), free_port()]
    logs = [tmp / f"worker{i}.log" for i in range(2)]
    procs = []
    for i, port in enumerate(ports):
        with logs[i].open("wb") as fh:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "prm_pipeline.cli",
                        "--config",
                        str(s.config_path),
                        "worker",
                        "--worker-id",
                        f"secure{i}",
                        "--metrics-port",
                        str(port),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        wait_until(
            lambda: all(_ready(p) for p in ports) or any(p.poll() is not None for p in procs),
            timeout_s=90,
            interval_s=0.1,
            what="both workers to join their group",
        )
        assert all(p.poll() is None for p in procs), "a worker exited:\n" + "\n".join(f.read_text() for f in logs)

        s.expected = {}
        gid = lambda tag: f"{name}-{tag}"  # noqa: E731
        messages: list[Any] = []
        for k in range(3):
            g = make_group(gid(f"ok{k}"), 2, turns=2, output_tokens=8)
            messages += g
            s.expected[g[0].group_id] = "accepted"
        messages += [_trajectory_offering_a_key(gid("offer"), 2, i) for i in range(2)]
        s.expected[gid("offer")] = "accepted"
        messages += make_group(gid("late"), 3, turns=1, output_tokens=4)[:2]  # one member never comes
        s.expected[gid("late")] = "rejected"

        async def publish() -> None:
            async with TrajectoryPublisher(cfg.kafka, cfg.topics) as pub:
                await pub.publish_many(messages)
                await pub.discard_group(gid("dropped"), reason="policy")
            producer = make_producer(cfg.kafka)
            await producer.start()
            try:  # not a trajectory: must become a dead letter
                await producer.send_and_wait(cfg.topics.trajectories, b"\x00garbage", key=gid("bad").encode())
            finally:
                await producer.stop()

        asyncio.run(publish())
        s.expected[gid("dropped")] = "discarded"
        s.expected[gid("bad")] = "rejected"  # its key names the group: rejected at once (invalid_member)

        async def train() -> set[str]:
            accepted = {g for g, st in s.expected.items() if st == "accepted"}
            got: set[str] = set()
            async with VerdictConsumer(cfg, group_filter=None, device="cpu", batch_groups=2) as consumer:

                async def read() -> None:
                    batch = await consumer.next_batch(idle_timeout_s=1.0)
                    if batch is not None:
                        got.update(batch.group_ids)

                await poll_until(lambda: accepted <= got, timeout_s=90, between=read)
            return got

        s.trainer_groups = asyncio.run(train())
        records = asyncio.run(
            read_topic(
                cfg,
                cfg.topics.verdicts,
                until=time.monotonic() + 60,
                stop_when=lambda rs: set(s.expected) <= {r.key.decode() for r in rs},
            )
        )
        s.verdict_records = records
        s.verdicts = {v.group_id: v for v in (decode_verdict(r.value, r.headers) for r in records)}
        s.dead_letters = asyncio.run(
            read_topic(cfg, cfg.topics.dead_letters, until=time.monotonic() + 30, stop_when=lambda rs: len(rs) >= 1)
        )
        s.metrics = [httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=5).text for p in ports]
        s.cli_verdicts = _cli(
            env, s.config_path, "verdicts", "--from-beginning", "--max", str(len(s.expected)), "--idle-timeout", "20"
        )
        s.cli_audit = _cli(
            env, s.config_path, "audit", "--groups", *[g for g, st in s.expected.items() if st == "accepted"], "--quiet"
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in procs]
        judge.stop()
    s.logs = [f.read_text(errors="replace") for f in logs]
    assert codes == [0, 0], f"workers did not stop cleanly: {codes}\n" + "\n".join(s.logs)[-4000:]
    stats = admin.info("commandstats")
    admin.close()
    s.commandstats = {k.removeprefix("cmdstat_"): v for k, v in stats.items()}
    s.authorizations = list(judge.authorizations)
    s.kafka_handshakes, s.redis_handshakes = kafka_proxy.handshakes, acl_redis.proxy.handshakes
    return s


def test_every_client_works_over_tls(scenario: Scenario) -> None:
    s = scenario
    got = {g: v.status for g, v in s.verdicts.items()}
    assert got == s.expected, f"verdicts {got} != expected {s.expected}\n" + "\n".join(s.logs)[-3000:]
    assert s.verdicts[next(g for g in got if g.endswith("-bad"))].reason.startswith("invalid_member: record traj.")
    assert s.trainer_groups == {g for g, st in s.expected.items() if st == "accepted"}
    assert len(s.dead_letters) == 1
    lines = [ln for ln in s.cli_verdicts.stdout.splitlines() if ln.strip()]
    assert s.cli_verdicts.returncode == 0 and len(lines) == len(s.expected), s.cli_verdicts.stderr
    assert s.cli_audit.returncode == 0, s.cli_audit.stdout + s.cli_audit.stderr
    # the broker advertises only the proxy and Redis is reached only through its proxy
    assert s.kafka_handshakes > 0 and s.redis_handshakes > 0


def test_judge_key_comes_from_the_environment_only(scenario: Scenario) -> None:
    assert scenario.authorizations, "the judge was never called"
    assert set(scenario.authorizations) == {f"Bearer {scenario.secrets['judge']}"}


CONDITIONAL_COMMANDS = {"hexists"}
LEDGER_SCRIPTS = Path(__file__).resolve().parents[2] / "scoring_workers" / "ledger_scripts.py"


def test_redis_commands_are_exactly_the_acl_grants(scenario: Scenario, acl_redis: AclRedis) -> None:
    """The ACL line of docs/deploy.md grants exactly what the ledger used in this run."""
    stats = scenario.commandstats
    used = {c for c, v in stats.items() if v.get("calls", 0) > 0} - ADMIN_COMMANDS - HANDSHAKE
    refused = {c for c, v in stats.items() if v.get("rejected_calls", 0) > 0} - IGNORED_REFUSALS
    granted = allowed_commands(acl_redis.acl)
    assert not refused, f"the ledger needed {sorted(refused)}, which the ACL line in docs/deploy.md refuses"
    # HEXISTS runs only when a redelivered member finds its group still open (the probe's
    # 'duplicate' answer), which this scenario need not hit; it must still be granted.
    conditional = {c for c in CONDITIONAL_COMMANDS if f"'{c.upper()}'" in LEDGER_SCRIPTS.read_text()}
    assert used <= granted and granted - used <= conditional, (
        f"docs/deploy.md grants {sorted(granted - used - conditional)} the ledger never used and misses "
        f"{sorted(used - granted)}; update the ACL line"
    )


def test_no_secret_leaks(scenario: Scenario) -> None:
    s = scenario
    cfg = s.cfg
    places: dict[str, str] = {
        **{f"worker{i} log": text for i, text in enumerate(s.logs)},
        **{f"worker{i} /metrics": text for i, text in enumerate(s.metrics)},
        "verdicts CLI": s.cli_verdicts.stdout + s.cli_verdicts.stderr,
        "audit CLI": s.cli_audit.stdout + s.cli_audit.stderr,
        "verdict records": "\n".join(repr((r.value, r.headers)) for r in s.verdict_records),
        "dead letters": "\n".join(repr((r.value, r.headers)) for r in s.dead_letters),
    }
    for obj in (cfg, cfg.kafka, cfg.redis, cfg.topics, cfg.worker, cfg.trainer, cfg.local, cfg.rollout, cfg.prm):
        places[f"repr({type(obj).__name__})"] = repr(obj) + str(obj)
    assert s.secrets["kafka"] == cfg.kafka.sasl_password and s.secrets["redis"] in cfg.redis.url  # they were in use
    leaks = [(where, kind) for where, text in places.items() for kind, secret in s.secrets.items() if secret in text]
    assert not leaks, f"secrets found: {leaks}"
