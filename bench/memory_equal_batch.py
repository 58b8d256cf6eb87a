"""Decode iteration time of two phases of `bench/memory.py trace`, compared at equal work.

The phases replay the same request trace, but not the same iterations: a phase whose steps
are a little slower keeps more requests in flight, so its batches are larger and its steps
slower still. The all-iteration p50 of the result rows (`decode_iter_ms_p50` and its
interval) mixes that batch composition into the comparison. Here each phase's busy iterations
are binned by decode batch (``bin_width`` rows) and by whether the step carried a prefill
chunk; the ratio is of the two phases' per-bin medians, summed over the bins both phases fill
(at least ``min_count`` iterations each) with weight min(count a, count b). Its 95% interval is
a bootstrap over iterations within each bin.

On the H200 (`bench/results/memory-trace-m{5,7,8}-h200-20261130.iterations.json`) it puts the
unified phases at 0.988-1.010x of `static_split` per iteration at equal batch (the step's
device part, ``wait_ms``, 0.983-1.014x), where the all-iteration p50 read 0.991-1.023x.

``PYTHONPATH=. python3 bench/memory_equal_batch.py ITERATIONS.json [...] --out FILE`` prints the
comparisons against `static_split` and writes them as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.provenance import commit_hash

Bins = dict[tuple[int, bool], list[float]]
KEYS = ("iteration_ms", "step_ms", "wait_ms")
"""The whole loop iteration, the decode step, and the step's wait for the device."""


def bins_of(rows: Sequence[dict[str, Any]], key: str, bin_width: int = 4) -> Bins:
    """``key`` of the busy iterations (decode rows > 0), by (batch // bin_width, chunk or not);
    iterations without a value for ``key`` are left out."""
    if bin_width < 1:
        raise ValueError(f"bin_width must be >= 1, got {bin_width}")
    out: Bins = defaultdict(list)
    for row in rows:
        value = row.get(key)
        if row["decode_batch"] > 0 and value is not None:
            out[row["decode_batch"] // bin_width, bool(row["prefill_tokens"])].append(value)
    return dict(out)


def equal_batch_ratio(a: Bins, b: Bins, min_count: int = 10) -> float | None:
    """Weighted per-bin medians of ``a`` over those of ``b`` (None: no bin both fill)."""
    num = den = 0.0
    for key, values in a.items():
        other = b.get(key)
        if other is None or len(values) < min_count or len(other) < min_count:
            continue
        weight = min(len(values), len(other))
        num += weight * statistics.median(values)
        den += weight * statistics.median(other)
    return num / den if den > 0 else None


def bootstrap_interval(
    a: Bins, b: Bins, reps: int = 300, seed: int = 0, min_count: int = 10
) -> tuple[float, float] | None:
    """95% interval of `equal_batch_ratio`, resampling iterations within each bin."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(reps):
        ra = {k: rng.choices(v, k=len(v)) for k, v in a.items()}
        rb = {k: rng.choices(v, k=len(v)) for k, v in b.items()}
        ratio = equal_batch_ratio(ra, rb, min_count)
        if ratio is not None:
            ratios.append(ratio)
    if not ratios:
        return None
    ratios.sort()
    low = ratios[int(0.025 * (len(ratios) - 1))]
    high = ratios[round(0.975 * (len(ratios) - 1))]
    return low, high


def compare_phases(
    phases: dict[str, list[dict[str, Any]]], baseline: str = "static_split", **options: Any
) -> dict[str, dict[str, Any]]:
    """Every other phase against ``baseline``: per key of `KEYS`, the equal-batch ratio and its
    interval (``options``: ``bin_width``, ``min_count``, ``reps``, ``seed``)."""
    if baseline not in phases:
        raise ValueError(f"no {baseline!r} phase among {sorted(phases)}")
    width = options.get("bin_width", 4)
    count = options.get("min_count", 10)
    base = {key: bins_of(phases[baseline], key, width) for key in KEYS}
    out: dict[str, dict[str, Any]] = {}
    for name, rows in phases.items():
        if name == baseline:
            continue
        entry: dict[str, Any] = {}
        for key in KEYS:
            a, b = bins_of(rows, key, width), base[key]
            interval = bootstrap_interval(
                a, b, options.get("reps", 300), options.get("seed", 0), count
            )
            entry[key] = {
                "ratio": equal_batch_ratio(a, b, count),
                "ci95": None if interval is None else list(interval),
            }
        out[f"{name}_over_{baseline}"] = entry
    return out


def load_phases(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The `<result>.iterations.json` table as phase -> rows (dicts by column)."""
    table = json.loads(path.read_text())
    columns = table["columns"]
    return {
        name: [dict(zip(columns, row, strict=True)) for row in rows]
        for name, rows in table["phases"].items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("iterations", nargs="+", type=Path)
    parser.add_argument("--bin-width", type=int, default=4)
    parser.add_argument("--min-count", type=int, default=10)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "name": "memory-equal-batch",
        "commit": commit_hash(),
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "derived_from": "the iteration rows of the files below (no GPU run of its own)",
        "config": {"bin_width": args.bin_width, "min_count": args.min_count, "reps": args.reps},
        "files": {},
    }
    for path in args.iterations:
        comparisons = compare_phases(
            load_phases(path), bin_width=args.bin_width, min_count=args.min_count, reps=args.reps
        )
        result["files"][path.name] = comparisons
        print(path.name)
        for pair, entry in comparisons.items():
            cells = []
            for key in KEYS:
                ratio, ci = entry[key]["ratio"], entry[key]["ci95"]
                interval = "" if ci is None else f" [{ci[0]:.4f}-{ci[1]:.4f}]"
                cells.append(f"{key} {ratio:.4f}{interval}" if ratio else f"{key} -")
            print(f"  {pair:36s} " + "  ".join(cells))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
