"""Test-only TLS for services that have none: a throwaway CA and a loopback TLS-terminating proxy.

The embedded broker (tansu 0.6) has no working TLS listener and the embedded valkey
was built without TLS. Putting :class:`TlsProxy` in front of them exercises the
clients' real TLS path — handshake, CA verification, hostname check — against the real
services behind it. The proxy runs its own event loop in a thread, so worker
*processes* and synchronous code can use it as well as async tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


@dataclass(frozen=True)
class Pki:
    """Files of one throwaway PKI: a CA, a server certificate for 127.0.0.1/localhost signed
    by it, and an unrelated CA (``other_ca``) that a client must not trust the server with."""

    ca: Path
    cert: Path
    key: Path
    other_ca: Path
    self_signed_cert: Path  # a server certificate from an issuer no client trusts
    self_signed_key: Path


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("prm-test-ca")
    _other_key, other_cert = _ca("prm-test-other-ca")
    now = dt.datetime.now(dt.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])

    def leaf(
        issuer_key: ec.EllipticCurvePrivateKey, issuer: x509.Name
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name("127.0.0.1"))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(san, critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(issuer_key, hashes.SHA256())
        )
        return key, cert

    key, cert = leaf(ca_key, ca_cert.subject)
    unknown_issuer = ec.generate_private_key(ec.SECP256R1())  # a signer nobody trusts
    ss_key, ss_cert = leaf(unknown_issuer, _name("unknown-issuer"))
    pem = serialization.Encoding.PEM
    paths = Pki(
        directory / "ca.pem",
        directory / "server.pem",
        directory / "server.key",
        directory / "other-ca.pem",
        directory / "self-signed.pem",
        directory / "self-signed.key",
    )
    paths.ca.write_bytes(ca_cert.public_bytes(pem))
    paths.cert.write_bytes(cert.public_bytes(pem))
    _write_key(key, paths.key)
    paths.other_ca.write_bytes(other_cert.public_bytes(pem))
    paths.self_signed_cert.write_bytes(ss_cert.public_bytes(pem))
    _write_key(ss_key, paths.self_signed_key)
    return paths


class TlsProxy:
    """``127.0.0.1:port`` (TLS with ``cert``/``key``; plain TCP without) -> ``127.0.0.1:upstream_port``.

    Counts completed handshakes, so a test can prove its traffic went through TLS, and
    the bytes forwarded each way (``bytes_in``: client -> service, ``bytes_out``: back),
    which is how ``bench capacity`` measures the broker's network traffic.
    """

    def __init__(self, upstream_port: int, cert: Path | None = None, key: Path | None = None, *, port: int = 0) -> None:
        self.upstream_port, self.port = upstream_port, port
        self.ctx: ssl.SSLContext | None = None
        if cert is not None:
            self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.ctx.load_cert_chain(cert, key)
        self.handshakes = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        # ``_accept`` runs only after a completed handshake; failed ones are dropped by asyncio.
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, ssl=self.ctx, ssl_handshake_timeout=10 if self.ctx else None
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)  # type: ignore[arg-type]
        try:
            self.handshakes += 1
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            except OSError:
                writer.close()
                return
            await self._relay(reader, writer, up_r, up_w)
        finally:
            self._conns.discard(task)  # type: ignore[arg-type]

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> None:
        """Forward bytes both ways until either side closes (a subclass may read frames instead)."""

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, inbound: bool) -> None:
            with contextlib.suppress(OSError, ssl.SSLError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    if inbound:
                        self.bytes_in += len(data)
                    else:
                        self.bytes_out += len(data)
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_w, True), pipe(up_r, writer, False))

    def stop(self) -> None:
        async def _stop() -> None:
            if self._server is not None:
                self._server.close()
            for t in list(self._conns):
                t.cancel()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
