"""Dedicated services for fault tests: they are restarted on purpose, so they are never
the session-wide broker/Redis that other tests share.

* ``persistent_redis`` — a Redis-compatible server with an append-only file
  (``--appendonly yes --appendfsync everysec``) in the test's own data dir.
* ``durable_broker`` — a tansu broker on ``s3://tansu/`` storage, backed by a loopback
  ``moto_server`` (``moto[server]``, a dev dependency), so topics, records and committed
  offsets survive a broker restart (see docs/faults.md, scenario 3).
"""

from __future__ import annotations

import shutil
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.local import (
    LocalService,
    LocalStackError,
    broker_service,
    free_port,
    redis_service,
    s3_storage_env,
)

S3_BUCKET = "tansu"


@pytest.fixture
def persistent_redis(tmp_path: Path) -> Iterator[LocalService]:
    svc = redis_service(tmp_path / "redis-aof", persistent=True)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def _moto_server() -> str:
    beside = Path(sys.executable).parent / "moto_server"  # the venv's console script
    found = str(beside) if beside.is_file() else shutil.which("moto_server")
    if not found:
        raise LocalStackError("moto_server not found: install the dev extra (pip install 'moto[server]')")
    return found


@pytest.fixture
def s3_endpoint(tmp_path: Path) -> Iterator[str]:
    """A loopback S3 (moto) with the broker's bucket created; yields its endpoint URL."""
    port = free_port()
    s3 = LocalService(
        "s3", [_moto_server(), "-H", "127.0.0.1", "-p", str(port)], port, tmp_path / "s3" / "logs" / "moto.log"
    )
    s3.start(ready_timeout_s=60)  # moto imports boto and friends: seconds, not milliseconds
    try:
        endpoint = f"http://127.0.0.1:{port}"
        request = urllib.request.Request(f"{endpoint}/{S3_BUCKET}", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200, f"creating bucket {S3_BUCKET!r} answered {response.status}"
        yield endpoint
    finally:
        s3.stop()


@pytest.fixture
def durable_broker(tmp_path: Path, s3_endpoint: str) -> Iterator[LocalService]:
    """A tansu broker with ``s3://tansu/`` storage; restart it with ``.restart()`` / ``.stop()`` + ``.start()``."""
    broker = broker_service(
        tmp_path / "broker-s3", storage_engine=f"s3://{S3_BUCKET}/", env=s3_storage_env(s3_endpoint)
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
