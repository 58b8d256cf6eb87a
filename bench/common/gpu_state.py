"""The GPU's clocks, temperature and power as `nvidia-smi` reports them at one instant.

Benchmarks record it before and after each timed run: a decode step's time follows the SM
clock, and a run that follows seconds of finetuning at full power may start on a hotter,
slower-clocked GPU than one that follows an idle pause.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

FIELDS = (
    ("clocks.sm", "sm_clock_mhz"),
    ("clocks.mem", "mem_clock_mhz"),
    ("temperature.gpu", "temperature_c"),
    ("power.draw", "power_w"),
    ("clocks_event_reasons.active", "clock_event_reasons"),
)


def parse_query(line: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """One `--format=csv,noheader,nounits` line as {key: number or text}."""
    values = [v.strip() for v in line.strip().split(",")]
    if len(values) != len(keys):
        raise ValueError(f"expected {len(keys)} values, got {len(values)}: {line!r}")
    out: dict[str, Any] = {}
    for key, value in zip(keys, values, strict=True):
        try:
            out[key] = float(value)
        except ValueError:
            out[key] = value  # "[N/A]", or the reasons bit mask in hex
    return out


def gpu_state(index: int = 0, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The state of GPU ``index`` now; None without `nvidia-smi` (CPU hosts) or when the
    query fails (the benchmark goes on without it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    for fields in (FIELDS, FIELDS[:-1]):  # older drivers lack the event-reasons field
        query = ",".join(name for name, _ in fields)
        try:
            done = subprocess.run(
                [exe, f"--id={index}", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0 and done.stdout.strip():
            try:
                return parse_query(done.stdout.splitlines()[0], tuple(k for _, k in fields))
            except ValueError:
                return None
    return None
