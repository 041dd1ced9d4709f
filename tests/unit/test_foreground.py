"""Foreground commands stop on SIGINT/SIGTERM, every time, and restore the old handlers."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from prm_pipeline.foreground import StopSignals

# Polls as fast as it can, so a signal lands at every point of the loop over the runs.
CHILD = """
import sys
from prm_pipeline.foreground import StopSignals
with StopSignals() as stop:
    print("ready", flush=True)
    sys.exit(stop.wait(poll_s=0))
"""


@pytest.mark.slow  # 10 child processes per signal
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_wait_with_code_zero(sig: signal.Signals) -> None:
    for _ in range(10):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(sig)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_check_returns_its_exit_code_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    calls = []

    def check() -> int | None:
        calls.append(1)
        return 3 if len(calls) == 2 else None

    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGTERM) != before
        assert stop.wait(check, poll_s=0) == 3
    assert signal.getsignal(signal.SIGTERM) == before and len(calls) == 2


def test_a_signal_received_before_the_wait_is_not_lost() -> None:
    with StopSignals() as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.wait(lambda: pytest.fail("waited although SIGTERM had arrived")) == 0
