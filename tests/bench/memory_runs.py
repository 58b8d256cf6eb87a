"""`python -m bench.memory trace` on the tiny model on CPU, as a user runs it: a subprocess, its
result file read back."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class TraceRun:
    result: dict[str, Any]
    """The result JSON."""
    path: Path
    """Where it was written."""
    stdout: str


def run_tiny_trace(tmp_path: Path, *flags: str) -> TraceRun:
    """The trace over a 0.05 GiB pool of 8 KiB CPU pages, 2 s of arrivals and 1 s of drain,
    requests of at most 256 tokens (decode keeps 16 pages for one: pages move), and ``flags``;
    what it wrote under ``tmp_path`` and printed."""
    command = [
        sys.executable,
        "-m",
        "bench.memory",
        "trace",
        "--model=tiny",
        "--device=cpu",
        "--duration=2",
        "--drain=1",
        "--pool-gib=0.05",
        "--reserve-low-pages=16",
        "--reserve-high-pages=48",
        "--step-pages=8",
        "--hysteresis=5",
        "--max-model-len=256",
        f"--out={tmp_path}",
        *flags,
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("memory-cpu-*[0-9].json")
    return TraceRun(json.loads(path.read_text()), path, proc.stdout)
