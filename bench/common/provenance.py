"""Which commit a benchmark ran at, and its result file."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


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


def gpu_slug(name: str) -> str:
    """The `<gpu>` of a result file's name: a known GPU's short name ("h200" for any H200), else
    the name in lower case with every other character a dash ("cpu" on the CPU)."""
    lowered = name.lower()
    for known in ("h200", "h100", "a100", "l40s"):
        if known in lowered:
            return known
    return "".join(ch if ch.isalnum() else "-" for ch in lowered).strip("-") or "gpu"


def write_result(
    name: str, out_dir: str | Path, gpu: str, torch_version: str, commit: str, **body: Any
) -> Path:
    """Write `<out_dir>/<name>-<gpu>-<yyyymmdd>.json` (bench/README.md's result file): `name`,
    `commit`, `gpu`, `torch`, `created`, then `body` (`config`, `rows`, ...). Returns the path."""
    now = datetime.datetime.now(datetime.UTC)
    out = Path(out_dir) / f"{name}-{gpu_slug(gpu)}-{now:%Y%m%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "name": name,
        "commit": commit,
        "gpu": gpu,
        "torch": torch_version,
        "created": now.isoformat(),
        **body,
    }
    out.write_text(json.dumps(document, indent=1))
    return out
