"""Services of the security tests: TLS in front of a dedicated broker and a dedicated Redis with ACLs.

* ``tls_kafka`` — a tansu broker that advertises only the address of a loopback
  :class:`~tests.security.tlsproxy.TlsProxy`, so every client (including those the
  metadata sends to "the broker") talks TLS; the plain port stays private to the proxy.
* ``acl_redis`` — a valkey of its own (admin: the passwordless default user on the
  plain port, used only by the tests), with the worker's ACL user created from the line
  in docs/deploy.md, behind a TLS proxy; and a second proxy presenting a certificate no
  trusted CA signed.
* ``sasl_kafka`` — a tansu broker started with ``--authentication`` and no users: it
  answers every SCRAM login with ``e=unknown-user``.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from infra.local import LocalService, broker_service, free_port, redis_service
from tests.security.tlsproxy import Pki, TlsProxy, make_pki

ROOT = Path(__file__).resolve().parents[2]
ACL_USER = "prm-worker"


def deploy_acl_line(password: str, prefix: str = "prm") -> list[str]:
    """The ``ACL SETUSER`` line of docs/deploy.md with the password (and key prefix) filled in."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    found = re.findall(r"^(ACL SETUSER prm-worker .+)$", text, re.M)
    assert len(found) == 1, (
        f"docs/deploy.md must hold exactly one 'ACL SETUSER prm-worker ...' line, found {len(found)}"
    )
    words = shlex.split(found[0])
    return [(">" + password) if w == ">PASSWORD" else w.replace("~prm:", f"~{prefix}:") for w in words]


def allowed_commands(acl_words: list[str]) -> set[str]:
    """The ``+command`` / ``+command|sub`` grants of an ACL line (lower case)."""
    return {w[1:].lower() for w in acl_words if w.startswith("+") and not w.startswith("+@")}


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def tls_kafka(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, TlsProxy]]:
    proxy_port = free_port()
    broker = broker_service(tmp_path_factory.mktemp("tls-broker"), log_name="tls-broker.log")
    argv = broker.argv
    argv[argv.index("--advertised-listener-url") + 1] = f"tcp://127.0.0.1:{proxy_port}"
    broker.start()
    proxy = TlsProxy(broker.port, pki.cert, pki.key, port=proxy_port).start()
    try:
        yield f"127.0.0.1:{proxy_port}", proxy
    finally:
        proxy.stop()
        broker.stop()


@pytest.fixture(scope="session")
def sasl_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    broker = broker_service(tmp_path_factory.mktemp("sasl-broker"), log_name="sasl-broker.log")
    broker.argv.append("--authentication")
    broker.start()
    try:
        yield f"127.0.0.1:{broker.port}"
    finally:
        broker.stop()


@dataclass
class AclRedis:
    service: LocalService
    proxy: TlsProxy
    untrusted_proxy: TlsProxy
    password: str
    acl: list[str]

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.service.port)

    def url(self, *, password: str | None = None, proxy: TlsProxy | None = None) -> str:
        port = (proxy or self.proxy).port
        return f"rediss://{ACL_USER}:{password or self.password}@127.0.0.1:{port}/0"


@pytest.fixture(scope="session")
def acl_redis(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    svc = redis_service(tmp_path_factory.mktemp("acl-redis"), log_name="acl-redis.log")
    svc.start()
    password = "redis-" + secrets.token_hex(12)
    acl = deploy_acl_line(password)
    admin = redis.Redis(port=svc.port)
    admin.execute_command(*acl)
    admin.close()
    proxy = TlsProxy(svc.port, pki.cert, pki.key).start()
    untrusted = TlsProxy(svc.port, pki.self_signed_cert, pki.self_signed_key).start()
    try:
        yield AclRedis(svc, proxy, untrusted, password, acl)
    finally:
        untrusted.stop()
        proxy.stop()
        svc.stop()
