"""Which commit a benchmark ran at, for its result file."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit_hash() -> str:
    """``HARLI_COMMIT`` or ``GIT_COMMIT`` when set (a tree copied to a GPU host may carry a
    stale ``.git``: the runner passes the commit it archived), else git's HEAD, else
    "unknown"."""
    for name in ("HARLI_COMMIT", "GIT_COMMIT"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
