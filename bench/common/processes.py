"""The processes a benchmark starts: waiting on them, their CPU time, and stopping them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def _stat_fields(stat: Path) -> list[str]:
    """`/proc/<pid>/stat`'s fields after the command name (which may hold spaces)."""
    return stat.read_text().rsplit(")", 1)[1].split()


def _ticks_s(fields: list[str]) -> float:
    """User plus system CPU time in these stat fields, in seconds."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of `pid` so far."""
    return _ticks_s(_stat_fields(Path(f"/proc/{pid}/stat")))


def group_cpu_seconds(group: int) -> float:
    """User plus system CPU time so far of every live process in process group `group` (a
    server's master and its workers)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry / "stat")
        except OSError:
            continue
        if int(fields[2]) == group:
            total += _ticks_s(fields)
    return total


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `check` every 0.2 s until it holds; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def stop_groups(procs: Iterable[subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """SIGTERM to each process's group, then SIGKILL to a group still there after `grace_s`."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
