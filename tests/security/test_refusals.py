"""What does not belong is kept out, and says so in one line.

Against the real embedded services (TLS through the loopback proxies of conftest.py):

* Kafka: a client that does not trust the broker's certificate, or speaks plaintext
  to its TLS listener, fails with one ``error:`` line naming the setting;
* Kafka SASL: the embedded broker with ``--authentication`` refuses every SCRAM login
  with ``e=unknown-user``; every client kind reports that as one line naming the user
  and the settings (aiokafka alone raises a bare ``KeyError: 'v'``), and every client
  is built with the SASL settings from the config and ``PRM_*`` variables;
* Redis: the worker's ACL user cannot read or write a key outside the ledger's prefix,
  not even from a script; a wrong password and an untrusted certificate stop a worker
  at start-up with one line, without printing the password.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import redis
from redis.exceptions import NoPermissionError, ResponseError

from infra.config import KafkaConfig, PipelineConfig, RedisConfig, TopicsConfig, load_config
from infra.kafka import KafkaAuthError, make_admin, make_consumer, make_producer
from infra.redis import make_redis, verify_access
from prm_pipeline.demo.processes import write_config
from tests.security.conftest import ACL_USER, ROOT, AclRedis

pytestmark = pytest.mark.integration


def _cli(
    config: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prm_pipeline.cli", "--config", str(config), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1, f"exit {proc.returncode}:\n{out}"
    assert "Traceback" not in out, out
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line:\n{out}"
    return lines[0]


def _config(tmp_path: Path, **kafka: object) -> Path:
    cfg = PipelineConfig(
        kafka=KafkaConfig(request_timeout_ms=5000, **kafka),
        topics=TopicsConfig(
            trajectories=f"t.{tmp_path.name}",
            verdicts=f"v.{tmp_path.name}",
            dead_letters=f"d.{tmp_path.name}",
            experiments=f"e.{tmp_path.name}",
        ),
    )
    return write_config(cfg, tmp_path / "config.yaml")


# --------------------------------------------------------------------------- Kafka TLS
def test_kafka_untrusted_certificate_is_one_line(tls_kafka, pki, tmp_path: Path) -> None:
    bootstrap, _ = tls_kafka
    line = _one_line_error(
        _cli(
            _config(tmp_path, bootstrap=bootstrap, security_protocol="SSL", ssl_cafile=str(pki.other_ca)),
            "topics",
            "create",
        )
    )
    assert "certificate is not trusted" in line and "kafka.ssl_cafile" in line and str(pki.other_ca) in line


def test_kafka_plaintext_client_on_tls_listener_is_one_line(tls_kafka, tmp_path: Path) -> None:
    bootstrap, _ = tls_kafka
    line = _one_line_error(_cli(_config(tmp_path, bootstrap=bootstrap), "topics", "create"))
    assert "security_protocol=PLAINTEXT" in line and "set kafka.security_protocol to SSL" in line


def test_kafka_trusted_certificate_works(tls_kafka, pki, tmp_path: Path) -> None:
    bootstrap, proxy = tls_kafka
    before = proxy.handshakes
    proc = _cli(
        _config(tmp_path, bootstrap=bootstrap, security_protocol="SSL", ssl_cafile=str(pki.ca)), "topics", "create"
    )
    assert proc.returncode == 0 and proc.stdout.count("created") == 4, proc.stdout + proc.stderr
    assert proxy.handshakes > before


# --------------------------------------------------------------------------- Kafka SASL
SASL_ENV = {
    "PRM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "PRM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "PRM_KAFKA_SASL_USERNAME": "prm-pipeline",
    "PRM_KAFKA_SASL_PASSWORD": "sasl-pw-7f3a9c",
}


async def test_every_client_gets_the_sasl_settings_from_env() -> None:
    cfg = load_config(None, environ={**SASL_ENV, "PRM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}).kafka
    assert (cfg.security_protocol, cfg.sasl_mechanism, cfg.sasl_username, cfg.sasl_password) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
        "prm-pipeline",
        "sasl-pw-7f3a9c",
    )
    assert "sasl-pw-7f3a9c" not in repr(cfg)
    for client in (make_producer(cfg), make_consumer(cfg, "t", group_id="g"), make_admin(cfg)):
        inner = getattr(client, "client", None) or client._client
        try:
            assert (
                inner._security_protocol,
                inner._sasl_mechanism,
                inner._sasl_plain_username,
                inner._sasl_plain_password,
                inner._ssl_context is not None,
            ) == ("SASL_SSL", "SCRAM-SHA-512", "prm-pipeline", "sasl-pw-7f3a9c", True), type(client)
        finally:
            await (client.close() if hasattr(client, "close") else client.stop())


def test_no_kafka_client_bypasses_the_factory() -> None:
    """Every Kafka client of the project comes from infra/kafka.py, so none misses the settings."""
    offenders = []
    for package in ("infra", "producers", "scoring_workers", "shaper", "prm_pipeline"):
        for path in (ROOT / package).rglob("*.py"):
            if path == ROOT / "infra" / "kafka.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in ("AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"Kafka clients built outside infra/kafka.py: {offenders}"


async def test_scram_refusal_is_named_for_every_client_kind(sasl_kafka: str) -> None:
    cfg = msgspec.structs.replace(
        load_config(None, environ=SASL_ENV).kafka, bootstrap=sasl_kafka, request_timeout_ms=5000
    )
    for client in (make_producer(cfg), make_consumer(cfg, "t", group_id="g"), make_admin(cfg)):
        with pytest.raises(KafkaAuthError) as info:
            await client.start()
        await (client.close() if hasattr(client, "close") else client.stop())
        msg = str(info.value)
        assert "'prm-pipeline'" in msg and "unknown-user" in msg and "PRM_KAFKA_SASL_PASSWORD" in msg
        assert "sasl-pw-7f3a9c" not in msg


def test_scram_refusal_on_the_command_line(sasl_kafka: str, tmp_path: Path) -> None:
    proc = _cli(_config(tmp_path, bootstrap=sasl_kafka), "topics", "create", env=SASL_ENV)
    line = _one_line_error(proc)
    assert "SCRAM-SHA-512 login of user 'prm-pipeline'" in line and "unknown-user" in line
    assert "sasl-pw-7f3a9c" not in proc.stdout + proc.stderr and "KeyError" not in line


# --------------------------------------------------------------------------- Redis
def test_acl_user_stays_inside_the_prefix(acl_redis: AclRedis) -> None:
    user = redis.Redis(port=acl_redis.service.port, username=ACL_USER, password=acl_redis.password)
    try:
        user.execute_command("HSET", "prm:{g1}:state", "status", "open")  # inside: allowed
        assert user.execute_command("HMGET", "prm:{g1}:state", "status") == [b"open"]
        for cmd in (
            ("SET", "other:key", "1"),
            ("GET", "other:key"),
            ("HSET", "prmx:{g}:state", "a", "b"),
            ("KEYS", "*"),
            ("FLUSHALL",),
            ("CONFIG", "GET", "*"),
            ("EVAL", "return 1", "0"),
        ):
            with pytest.raises(NoPermissionError):
                user.execute_command(*cmd)
        # a loaded script runs with the caller's rights: it cannot reach outside the prefix either
        sha = user.execute_command("SCRIPT", "LOAD", "return redis.call('HSET', KEYS[1], 'a', '1')")
        with pytest.raises(ResponseError, match="(?i)no permissions|noperm"):
            user.execute_command("EVALSHA", sha, "1", "other:key")
        assert user.execute_command("EVALSHA", sha, "1", "prm:{g1}:done") == 1
    finally:
        admin = acl_redis.admin()
        admin.delete("prm:{g1}:state", "prm:{g1}:done")
        admin.close()
        user.close()


def _worker_config(tmp_path: Path, ca: Path, kafka_bootstrap: str) -> Path:
    # a reachable broker: the worker's start-up waits for Kafka first, then checks Redis
    cfg = PipelineConfig(
        redis=RedisConfig(url="redis://unset/0", ssl_ca_certs=str(ca)),
        kafka=KafkaConfig(bootstrap=kafka_bootstrap, request_timeout_ms=3000),
    )
    return write_config(cfg, tmp_path / "worker.yaml")


def test_wrong_redis_password_stops_the_worker_in_one_line(
    acl_redis: AclRedis, pki, tmp_path: Path, kafka_bootstrap: str
) -> None:
    wrong = "wrong-" + acl_redis.password
    proc = _cli(
        _worker_config(tmp_path, pki.ca, kafka_bootstrap),
        "worker",
        env={"PRM_REDIS_URL": acl_redis.url(password=wrong)},
        timeout=60,
    )
    line = _one_line_error(proc)
    assert f"as user '{ACL_USER}'" in line and "PRM_REDIS_URL" in line and "login refused" in line
    assert wrong not in proc.stdout + proc.stderr and acl_redis.password not in proc.stdout + proc.stderr


def test_untrusted_redis_certificate_stops_the_worker_in_one_line(
    acl_redis: AclRedis, pki, tmp_path: Path, kafka_bootstrap: str
) -> None:
    proc = _cli(
        _worker_config(tmp_path, pki.ca, kafka_bootstrap),
        "worker",
        env={"PRM_REDIS_URL": acl_redis.url(proxy=acl_redis.untrusted_proxy)},
        timeout=60,
    )
    line = _one_line_error(proc)
    assert "certificate is not trusted" in line and "redis.ssl_ca_certs" in line
    assert acl_redis.password not in proc.stdout + proc.stderr


async def test_redis_tls_with_the_right_ca_passes_the_check(acl_redis: AclRedis, pki, caplog) -> None:
    good = RedisConfig(url=acl_redis.url(), ssl_ca_certs=str(pki.ca))
    client = make_redis(good)
    try:
        await verify_access(client, good)
    finally:
        await client.aclose()
    # plaintext to a TLS port looks like a Redis that hangs up: warned about, left to the
    # worker's retries (a restarting Redis must not kill workers), never a login error
    plain_to_tls = RedisConfig(url=acl_redis.url().replace("rediss://", "redis://"))
    client = make_redis(plain_to_tls, socket_timeout=3)
    try:
        await verify_access(client, plain_to_tls)
    finally:
        await client.aclose()
    assert "not reachable at start-up" in caplog.text and acl_redis.password not in caplog.text
