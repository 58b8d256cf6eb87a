"""The test command's dependency audit (`scripts/audit.py`), run as the test command runs it:
on pip-audit JSON reports of each shape (the test command itself runs it on the lock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AUDIT = ROOT / "scripts" / "audit.py"


def _judge(tmp_path: Path, deps: list[dict[str, object]], **env: str) -> tuple[int, str]:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"dependencies": deps, "fixes": []}))
    done = subprocess.run(
        [sys.executable, str(AUDIT), "--report", str(report)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=60,
    )  # fmt: skip
    return done.returncode, done.stdout


def test_a_known_vulnerability_fails_and_names_its_id_and_fix(tmp_path: Path) -> None:
    rc, out = _judge(tmp_path, [
        {"name": "django", "version": "5.2.0", "vulns": [
            {"id": "PYSEC-2026-1", "fix_versions": ["5.2.9"], "aliases": [], "description": ""}]},
        {"name": "celery", "version": "5.7.0", "vulns": []},
    ])  # fmt: skip
    assert rc == 1
    assert out.splitlines() == [
        "pip-audit: FAILED: 1 locked package(s) with known vulnerabilities",
        "  django 5.2.0: PYSEC-2026-1 (fixed in 5.2.9)",
    ]


def test_an_index_without_vulnerability_data_is_a_visible_skip(tmp_path: Path) -> None:
    deps: list[dict[str, object]] = [
        {"name": n, "skip_reason": f"Dependency not found on PyPI and could not be audited: {n}"}
        for n in ("celery", "django")
    ]
    rc, out = _judge(tmp_path, deps)
    assert rc == 0
    assert out.startswith("pip-audit: SKIPPED: the vulnerability service knows none of the 2 ")
    rc, out = _judge(tmp_path, deps, HARLI_AUDIT_REQUIRED="1")
    assert rc == 1 and out.startswith("pip-audit: FAILED (HARLI_AUDIT_REQUIRED=1): ")


def test_an_audit_names_what_it_could_not_check(tmp_path: Path) -> None:
    rc, out = _judge(tmp_path, [
        {"name": "celery", "version": "5.7.0", "vulns": []},
        {"name": "django", "version": "5.2.0", "vulns": []},
        {"name": "local-wheel", "skip_reason": "Dependency not found on PyPI"},
    ])  # fmt: skip
    assert rc == 0
    assert out.splitlines() == [
        "pip-audit: 2 locked packages audited, no known vulnerabilities",
        "  1 could not be audited: local-wheel",
    ]


def test_a_report_without_dependencies_fails(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text("{}")
    done = subprocess.run([sys.executable, str(AUDIT), "--report", str(report)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "no dependency list" in done.stdout
