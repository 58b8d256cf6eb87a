"""Running a benchmark script the way a user does, for the CPU smoke tests."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RESULT_HEAD = ["name", "commit", "gpu", "torch", "created", "config"]
"""The keys bench/README.md asks every result file to open with, in that order."""


def run_script(
    package: str, args: list[str], out: Path, name: str, env: dict[str, str] | None = None
) -> tuple[str, Path]:
    """Run `python -m bench.<package>` from the repository root with `args` writing into `out`
    (a fresh folder); check it exits 0
    and wrote exactly one file, `<name>-cpu-<yyyymmdd>.json` (the day it started or ended).
    Returns (its stdout, that file)."""
    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{package}", *args, "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = out.iterdir()
    after = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert path.name in {f"{name}-cpu-{d}.json" for d in (day, after)}, path.name
    return result.stdout, path
