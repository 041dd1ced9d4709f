"""Sampling processes and Redis from the outside, shared by ``bench soak`` and ``bench capacity``.

Every figure comes from the kernel or the server, not from the code under test:

* per process (any pid on this machine): CPU seconds (``utime + stime`` from
  ``/proc/PID/stat``), resident memory (``/proc/PID/statm``) and wake-ups (voluntary
  context switches of all its threads, ``/proc/PID/task/*/status``: each time it blocked
  and was woken again — on a VM a wake-up has a fixed CPU cost whatever the work after it). Not network bytes:
  ``/proc/PID/io`` misses ``recvfrom``/``sendto``-style socket calls (the broker's),
  so ``bench capacity`` counts the broker's bytes at a proxy instead;
* Redis: ``INFO`` (``used_memory``, ``total_net_input_bytes`` / ``output``, its own CPU)
  and ``DBSIZE``.

Also the least-squares slope used to call a series flat or growing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcReading:
    cpu_s: float
    rss_bytes: int
    wakeups: int = 0


def read_proc(pid: int) -> ProcReading | None:
    """One reading of ``pid``; ``None`` when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    # fields after "(comm)": state is [0], utime [11], stime [12] (man 5 proc, fields 14/15)
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return ProcReading(cpu, resident_pages * PAGE_SIZE, _wakeups(pid))


def _wakeups(pid: int) -> int:
    """Voluntary context switches summed over the threads of ``pid`` (0 if unreadable)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue  # a thread that ended between the listing and the read
    return total


async def redis_reading(client: Any) -> dict[str, float]:
    """``used_memory``, key count, network bytes in/out, server CPU seconds and commands processed."""
    info = await client.info()
    return {
        "used_memory": float(info["used_memory"]),
        "keys": float(await client.dbsize()),
        "net_in": float(info["total_net_input_bytes"]),
        "net_out": float(info["total_net_output_bytes"]),
        "cpu_s": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
        "commands": float(info["total_commands_processed"]),
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (NaN when empty)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def mib(n: float) -> str:
    return f"{n / 1048576:.1f} MiB"
