"""A loopback Kafka proxy that counts the bytes each way and makes clients stay behind it.

``bench capacity`` charges the broker's network bytes to it by putting this proxy between
every client and the broker. A client learns the broker's address from Metadata and
FindCoordinator responses and connects there; tansu can be told to advertise another
address (``--advertised-listener-url``), noida-db advertises the one it listens on. So
the proxy reads whole Kafka frames (4-byte size, then the frame), remembers which
requests were Metadata (API key 3) or FindCoordinator (10), and in their responses
replaces the broker's ``127.0.0.1`` + port with its own (same length: the frame is
unchanged otherwise). Both brokers go through the same frame-by-frame proxy, so its cost
(in the benchmark process, on the same cores) is the same for both.

Bytes are counted as forwarded, frames included: ``bytes_in`` client -> broker,
``bytes_out`` back.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

from tests.security.tlsproxy import TlsProxy

HOST = b"127.0.0.1"
REWRITTEN_APIS = (3, 10)  # Metadata, FindCoordinator


class KafkaCountingProxy(TlsProxy):
    """``127.0.0.1:port`` -> ``127.0.0.1:upstream_port`` (plain TCP), counting bytes, rewriting advertised ports."""

    def __init__(self, upstream_port: int, *, port: int = 0) -> None:
        super().__init__(upstream_port, port=port)
        self.rewrites = 0

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> None:
        rewrite: set[bytes] = set()  # correlation ids (raw) of requests whose answers name the broker
        old = HOST + struct.pack(">i", self.upstream_port)
        new = HOST + struct.pack(">i", self.port)

        async def requests() -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while True:
                    head = await reader.readexactly(4)
                    frame = await reader.readexactly(struct.unpack(">i", head)[0])
                    if struct.unpack_from(">h", frame)[0] in REWRITTEN_APIS:
                        rewrite.add(frame[4:8])
                    self.bytes_in += 4 + len(frame)
                    up_w.write(head + frame)
                    await up_w.drain()
            with contextlib.suppress(Exception):
                up_w.close()

        async def responses() -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while True:
                    head = await up_r.readexactly(4)
                    frame = await up_r.readexactly(struct.unpack(">i", head)[0])
                    if rewrite and frame[:4] in rewrite:
                        rewrite.discard(frame[:4])
                        if old in frame:
                            frame = frame.replace(old, new)
                            self.rewrites += 1
                    self.bytes_out += 4 + len(frame)
                    writer.write(head + frame)
                    await writer.drain()
            with contextlib.suppress(Exception):
                writer.close()

        await asyncio.gather(requests(), responses())
