"""Does a change move a benchmark's figures? One benchmark package run in this tree and in an
earlier one, alternately in one invocation (new, old, new, old, ...), merged into one result
file with the ratio of every figure and the spread between repeats of one tree (A/A).

Absolute times drift between GPU leases; runs interleaved in one call share the machine's state,
so `mean(new) / mean(old)` beside the A/A spread says whether a difference is above noise.

Run: `python -m bench.ab --before-tree DIR [--runs 2] [--name NAME] --package-args "ARGS"
PACKAGE`, e.g. `python -m bench.ab --before-tree .ab-before --package-args "--models llama3-8b
--batches 1,8,64 --contexts 512 --hf-eager '' --hf-compile '' --prefill-chunks ''" decode`.
`DIR` is a checkout of the earlier commit (`git worktree add DIR REV`); each run is
`python -m bench.PACKAGE ARGS --out TMP` with that tree as its working directory, and must write
exactly one result file whose `rows` carry the keys given by `--key` and `--figure`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ab.merge import merge_runs, print_ratios
from bench.common.provenance import ROOT, commit_hash, write_result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-tree", required=True, type=Path)
    parser.add_argument("--before-commit", default="", help="recorded in the result")
    parser.add_argument("--runs", type=int, default=2, help="runs per tree (alternating)")
    parser.add_argument("--name", default="", help="result name (default: PACKAGE-ab)")
    parser.add_argument(
        "--key",
        default="model,system,batch,context",
        help="row fields that identify one configuration across runs",
    )
    parser.add_argument("--figure", default="tpot_ms_p50", help="comma list of figures")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument(
        "--package-args", default="", help="the package's options, one string (shell quoting)"
    )
    parser.add_argument("package")
    args = parser.parse_args(argv)
    args.args = shlex.split(args.package_args)
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be >= 1")
    if not (args.before_tree / "bench").is_dir():
        parser.error(f"--before-tree {args.before_tree} holds no bench/ package")
    return args


COMPANION_SUFFIXES = (".iterations.json", ".meta.json")
"""Files a package writes beside its result (per-iteration tables, metadata): not results."""


def result_file(out: Path, command: list[str]) -> Path:
    """The one result file a run wrote under `out` (companions beside it are left out)."""
    files = sorted(p for p in out.glob("*.json") if not p.name.endswith(COMPANION_SUFFIXES))
    if len(files) != 1:
        raise RuntimeError(f"{command} wrote {len(files)} result files, expected one")
    return files[0]


def run_once(tree: Path, package: str, extra: list[str], commit: str) -> dict[str, Any]:
    """One run of `python -m bench.PACKAGE` in `tree`; its result document, with `wall_s`."""
    with tempfile.TemporaryDirectory(prefix="harli-ab-") as out:
        path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")]))
        env = {**os.environ, "HARLI_COMMIT": commit, "PYTHONPATH": path}
        command = [sys.executable, "-m", f"bench.{package}", *extra, "--out", out]
        start = time.perf_counter()
        subprocess.run(command, cwd=tree, env=env, check=True)
        wall_s = time.perf_counter() - start
        document: dict[str, Any] = json.loads(result_file(Path(out), command).read_text())
    document["wall_s"] = round(wall_s, 1)
    return document


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    new_commit = commit_hash()
    old_commit = args.before_commit or "before"
    order = [(tree, f"{tree}{i}") for i in range(1, args.runs + 1) for tree in ("new", "old")]
    trees = {"new": ROOT, "old": args.before_tree.resolve()}
    commits = {"new": new_commit, "old": old_commit}
    keys = args.key.split(",")
    figures = args.figure.split(",")
    documents: dict[str, dict[str, Any]] = {}
    for tree, run in order:
        print(f"== {run}: bench.{args.package} in {trees[tree]}", flush=True)
        documents[run] = run_once(trees[tree], args.package, args.args, commits[tree])
        merge_runs({run: documents[run]}, keys=keys, figures=figures)  # a bad --key fails now
    rows, ratios = merge_runs(documents, keys=keys, figures=figures)
    first = documents["new1"]
    out = write_result(
        args.name or f"{args.package}-ab",
        args.out,
        gpu=first.get("gpu", "unknown"),
        torch_version=first.get("torch", "unknown"),
        commit=new_commit,
        config={
            "package": args.package,
            "args": args.args,
            "before_commit": old_commit,
            "order": [run for _, run in order],
            "runs": {
                run: {"commit": d.get("commit"), "wall_s": d["wall_s"], "config": d.get("config")}
                for run, d in documents.items()
            },
            "method": "runs alternate new/old in one invocation; ratio = mean(new) / mean(old) "
            "per configuration; aa_spread = max/min - 1 over the runs of one tree",
        },
        rows=rows,
        ratios=ratios,
    )
    print_ratios(ratios, keys=keys)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
