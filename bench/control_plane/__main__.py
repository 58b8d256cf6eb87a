"""`python -m bench.control_plane`: placement and reconciliation time against the queue's length,
this tree against a previous commit in the same run.

For each queue length (`--jobs`, default 1,000 and 10,000) and each tree (`after`: this one;
`before`: `--before`, checked out in a temporary git worktree), `bench/control_plane/measure.py`
runs in its own process on a fresh PostgreSQL database with that tree's code (its docstring says
what is timed). Rows: one per (system, queued_jobs). Ratios: before / after of each time. The
beat interval (`HARLI_RECONCILE_INTERVAL_S`, 5 s by default) is the bound a pass must stay under.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common.cli_types import positive_ints
from bench.common.provenance import ROOT, commit_hash, write_result

MEASURE = Path(__file__).resolve().with_name("measure.py")
TIMES = ("placement_first_s", "placement_steady_s", "reconcile_s", "new_job_place_s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__)
    p.add_argument("--jobs", type=positive_ints("--jobs"), default=[1000, 10000])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--tenants", type=int, default=10)
    p.add_argument("--before", default="main",
                   help="the commit to compare with ('' to skip)")  # fmt: skip
    p.add_argument("--before-full-max-jobs", type=int, default=1000,
                   help="above this queue length the previous commit runs only its "
                   "reconcile pass and the new job (its placement passes take minutes at "
                   "10,000)")  # fmt: skip
    p.add_argument("--out", default="bench/results")
    return p.parse_args()


def measure(
    tree: Path, jobs: int, args: argparse.Namespace, only_reconcile: bool
) -> dict[str, Any]:
    env = os.environ | {
        "PYTHONPATH": str(tree),
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "HARLI_TEST_DB": "postgres",
        "HARLI_TEST_DATABASE": f"bench_control_plane_{os.getpid()}",
        "HARLI_QUOTA_QUEUED_JOBS": str(10 * jobs),  # the fixture's queue is not a quota test
    }
    command = [sys.executable, str(MEASURE), "--jobs", str(jobs), "--hosts", str(args.hosts),
               "--tenants", str(args.tenants)]  # fmt: skip
    if only_reconcile:
        command.append("--only-reconcile")
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"measure.py failed in {tree}:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    args = parse_args()
    trees: list[tuple[str, Path, str]] = [("after", ROOT, commit_hash())]
    scratch = tempfile.TemporaryDirectory(prefix="harli-bench-before-")
    before = ""
    if args.before:
        before = subprocess.check_output(
            ["git", "rev-parse", args.before], cwd=ROOT, text=True
        ).strip()
        path = Path(scratch.name) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), before], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        trees.insert(0, ("before", path, before))
    rows: list[dict[str, Any]] = []
    try:
        for jobs in args.jobs:
            for system, tree, commit in trees:
                only_reconcile = system == "before" and jobs > args.before_full_max_jobs
                row = {"system": system, "commit": commit, "config_jobs": jobs,
                       **measure(tree, jobs, args, only_reconcile)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if args.before:
            scratch_tree = str(Path(scratch.name) / "tree")
            subprocess.run(["git", "worktree", "remove", "--force", scratch_tree], cwd=ROOT,
                           check=False, capture_output=True)  # fmt: skip
        scratch.cleanup()
    ratios = []
    for jobs in args.jobs:
        pair = {r["system"]: r for r in rows if r["config_jobs"] == jobs}
        if "before" in pair and "after" in pair:
            ratios.append({"queued_jobs": jobs} | {
                f"{key}_before_over_after": pair["before"][key] / pair["after"][key]
                for key in TIMES if pair["before"].get(key) and pair["after"].get(key)
            })  # fmt: skip
    cpu = platform.processor() or platform.machine()
    path = write_result(
        "control_plane", args.out, gpu="cpu", torch_version="", commit=commit_hash(),
        config={"jobs": args.jobs, "hosts": args.hosts, "tenants": args.tenants,
                "before": before, "database": "postgresql", "cpu": cpu,
                "placements_per_pass": int(os.environ.get("HARLI_PLACEMENTS_PER_PASS", 100)),
                "beat_interval_s": int(os.environ.get("HARLI_RECONCILE_INTERVAL_S", 5))},
        rows=rows, ratios=ratios,
    )  # fmt: skip
    print(f"\n{'system':<8}{'queued':>8}{'place 1st s':>13}{'place s':>10}{'reconcile s':>13}"
          f"{'new job s':>11}{'queries':>9}")  # fmt: skip
    def cell(value: Any, width: int) -> str:
        return f"{value:>{width}.3f}" if isinstance(value, float) else f"{'-':>{width}}"

    for r in rows:
        print(f"{r['system']:<8}{r['queued_jobs']:>8}{cell(r.get('placement_first_s'), 13)}"
              f"{cell(r.get('placement_steady_s'), 10)}{cell(r['reconcile_s'], 13)}"
              f"{cell(r['new_job_place_s'], 11)}{r['reconcile_queries']:>9}")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
