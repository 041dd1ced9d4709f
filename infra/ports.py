"""Listening ports: one bound for every port a setting or flag names, one line when it is taken.

Every process that listens (the gateway, the ``/metrics`` of worker, trainer and status,
the demo's model server and fake judge) reads its port through :data:`Port` (a config
field) or :func:`prm_pipeline.flags.port` (a flag), both bounded here: 0 to
:data:`MAX_PORT`, 0 meaning "any free port". Without the bound, 99999 reached the socket
layer, which takes it modulo 65536 and listens on 34463.

A port that cannot be had (in use, or refused by the OS) is :class:`PortUnavailable`:
a configuration error (exit 2) whose one line names the flag or setting to change
(:func:`port_unavailable`), never a traceback. Once bound, the process says where it
listens (:func:`log_listening`) — the only way to find a port 0 picked.
"""

from __future__ import annotations

import errno
import logging
from typing import Annotated

import msgspec

from infra.errors import ConfigError

__all__ = ["MAX_PORT", "Port", "PortUnavailable", "log_listening", "port_unavailable"]

MAX_PORT = 65535
Port = Annotated[int, msgspec.Meta(ge=0, le=MAX_PORT)]
"""A config field's listening port: 0 (any free port) to :data:`MAX_PORT`."""


class PortUnavailable(ConfigError):
    """A port a flag or setting names cannot be listened on; ``str()`` is one line naming it."""


def port_unavailable(exc: OSError, host: str, port: int, setting: str) -> PortUnavailable:
    """The one-line error for a failed bind of ``host:port``, naming the ``setting`` that chose it."""
    if exc.errno == errno.EADDRINUSE:
        reason = "the port is already in use; choose another (0: any free one)"
    elif exc.errno == errno.EACCES:
        reason = "permission denied (ports below 1024 need privileges); choose another (0: any free one)"
    else:
        reason = exc.strerror or str(exc)
    return PortUnavailable(f"{setting}: cannot listen on {host}:{port}: {reason}")


def log_listening(log: logging.Logger, what: str, url: str) -> None:
    """``<what> listening on <url>`` at INFO: the address actually bound (the port 0 picked)."""
    log.info("%s listening on %s", what, url)
