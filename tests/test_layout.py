"""The runtime packages must never import Django: a runtime host has no control-plane database."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTROL_PLANE = {
    "django",
    "rest_framework",
    "drf_spectacular",
    "api",
    "workers",
    "console",
    "config",
}


def test_runtime_packages_do_not_import_django() -> None:
    offenders = []
    for package in ("gpu_runtime", "predictor_models"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] in CONTROL_PLANE:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert offenders == []
