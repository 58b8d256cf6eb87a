"""The import layer rules hold: every contract in pyproject.toml's `[tool.importlinter]` (the
layers, the runtime never importing Django or the control plane, the control plane importing
no torch, no import cycles), so `pytest` alone checks them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_import_contract_holds() -> None:
    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
