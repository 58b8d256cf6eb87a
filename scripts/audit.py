"""The test command's dependency audit: pip-audit over requirements.lock, with a verdict that
says what was and was not checked.

    python scripts/audit.py                 # run pip-audit on the lock and judge its report
    python scripts/audit.py --report FILE   # judge a pip-audit JSON report already written

Exit status 1 when a locked package has a known vulnerability (each is printed with its id and
the versions that fix it). When no vulnerability database can be reached (no network, or a
package index that carries no vulnerability data, so every package comes back "could not be
audited"), the audit is SKIPPED and says so on one visible line with the reason; with
HARLI_AUDIT_REQUIRED=1 a skip fails too, for machines that must audit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
TIMEOUT_S = 180


@dataclass(frozen=True)
class Verdict:
    failed: bool
    lines: list[str]


def judge(report: dict[str, object], *, required: bool) -> Verdict:
    """The verdict on a pip-audit JSON report (`pip-audit -f json`)."""
    deps = report.get("dependencies")
    if not isinstance(deps, list):
        return Verdict(True, ["pip-audit: FAILED: the report has no dependency list"])
    vulnerable = [d for d in deps if d.get("vulns")]
    skipped = [d for d in deps if d.get("skip_reason")]
    audited = len(deps) - len(skipped)
    if vulnerable:
        lines = [
            f"pip-audit: FAILED: {len(vulnerable)} locked package(s) with known vulnerabilities"
        ]
        for dep in vulnerable:
            for vuln in dep["vulns"]:
                fixes = ", ".join(vuln.get("fix_versions") or []) or "no fixed version"
                lines.append(
                    f"  {dep['name']} {dep.get('version', '?')}: {vuln['id']} (fixed in {fixes})"
                )
        return Verdict(True, lines)
    if deps and audited == 0:
        reason = str(skipped[0]["skip_reason"])
        return _skip(
            f"the vulnerability service knows none of the {len(deps)} locked packages "
            f"(first: {reason!r}): this package index carries no vulnerability data",
            required,
        )
    lines = [f"pip-audit: {audited} locked packages audited, no known vulnerabilities"]
    if skipped:
        names = ", ".join(sorted(str(d["name"]) for d in skipped))
        lines.append(f"  {len(skipped)} could not be audited: {names}")
    return Verdict(False, lines)


def _skip(reason: str, required: bool) -> Verdict:
    word = "FAILED (HARLI_AUDIT_REQUIRED=1)" if required else "SKIPPED"
    return Verdict(required, [f"pip-audit: {word}: {reason}"])


def run_pip_audit() -> tuple[dict[str, object] | None, str]:
    """pip-audit's JSON report on the lock, or None and why there is none."""
    command = [
        sys.executable, "-m", "pip_audit", "-r", str(LOCK), "--no-deps", "--disable-pip",
        "--progress-spinner", "off", "-f", "json",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"pip-audit did not answer within {TIMEOUT_S} s"
    try:
        return json.loads(done.stdout), ""
    except json.JSONDecodeError:
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        last = errors[-1] if errors else f"exit status {done.returncode}"
        return None, f"no vulnerability database reachable ({last[:200]})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, help="judge this pip-audit JSON report")
    args = parser.parse_args()
    required = os.environ.get("HARLI_AUDIT_REQUIRED") == "1"
    if args.report is not None:
        report: dict[str, object] | None = json.loads(args.report.read_text())
        why = ""
    else:
        report, why = run_pip_audit()
    verdict = _skip(why, required) if report is None else judge(report, required=required)
    print("\n".join(verdict.lines))
    return 1 if verdict.failed else 0


if __name__ == "__main__":
    sys.exit(main())
