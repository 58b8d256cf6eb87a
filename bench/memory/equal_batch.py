"""Decode iteration time of two phases of `python -m bench.memory trace`, compared at equal work.

The phases replay the same request trace, but not the same iterations: a phase whose steps
are a little slower keeps more requests in flight, so its batches are larger and its steps
slower still. The all-iteration p50 of the result rows (`decode_iter_ms_p50` and its
interval) mixes that batch composition into the comparison. Here each phase's busy iterations
are binned by decode batch (``bin_width`` rows) and by whether the step carried a prefill
chunk; the ratio is of the two phases' per-bin medians, summed over the bins both phases fill
(at least ``min_count`` iterations each) with weight min(count a, count b). Its 95% interval is
a bootstrap over iterations within each bin.

Noise, measured in the same run: a trace may run a phase more than once (`--phases
static_split,unified_release,static_split,unified_release`; repeats labelled `<phase>#2`, ...,
each configured as its phase's first run: bench/memory/args.py). Then `compare_phases` also
gives, per key, each repeat over its phase's first run (A/A: `static_split#2_over_static_split`,
the same binning and bootstrap) and every pairing of a compared phase's runs with the
baseline's (`occurrence_pairs`: `unified_release_over_static_split`,
`unified_release#2_over_static_split#2`, `unified_release_over_static_split#2`, ...). Each A/B
pairing carries a verdict per key, ``within_noise``: true when the distance of its ratio from
1.0 is no larger than the largest distance from 1.0 of any A/A ratio of that key in the same
run, false when larger, null when the run has no repeat (or either ratio is missing). A phase's
verdict is that of its first runs' pairing (`<phase>_over_<baseline>`, the figure a run without
repeats reports); the other pairings show whether it holds however the runs are paired. Without
repeats the output is as it was, with ``within_noise`` null.

``python -m bench.memory.equal_batch ITERATIONS.json [...] --out FILE`` prints the
comparisons against `static_split` (and with repeats the A/A spread and the verdicts) and writes
them as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.common.provenance import commit_hash
from bench.memory.args import occurrence_pairs, occurrences, phase_of

Bins = dict[tuple[int, bool], list[float]]
KEYS = ("iteration_ms", "step_ms", "wait_ms")
"""The whole loop iteration, the decode step, and the step's wait for the device."""
WITHIN_NOISE_RULE = (
    "within_noise: |A/B ratio - 1| <= the largest |A/A ratio - 1| of the same key in the same "
    "run (A/A: a repeat of a phase over its first run); null without a repeat"
)


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
    """Every other phase against ``baseline``: per key of `KEYS`, the equal-batch ratio, its
    interval and ``within_noise`` (``options``: ``bin_width``, ``min_count``, ``reps``,
    ``seed``). ``phases`` is keyed by label; with repeats, every pairing of a phase's runs with
    the baseline's, then each repeat over its phase's first run (A/A, no verdict), as the
    module's docstring says. ``<a>_over_<b>`` -> {key: {"ratio", "ci95"[, "within_noise"]}}."""
    if baseline not in phases:
        raise ValueError(f"no {baseline!r} phase among {sorted(phases)}")
    width = options.get("bin_width", 4)
    count = options.get("min_count", 10)
    binned: dict[tuple[str, str], Bins] = {}

    def bins(label: str, key: str) -> Bins:  # each run binned once per key
        if (label, key) not in binned:
            binned[label, key] = bins_of(phases[label], key, width)
        return binned[label, key]

    def entry(a: str, b: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in KEYS:
            interval = bootstrap_interval(
                bins(a, key), bins(b, key), options.get("reps", 300), options.get("seed", 0), count
            )
            out[key] = {
                "ratio": equal_batch_ratio(bins(a, key), bins(b, key), count),
                "ci95": None if interval is None else list(interval),
            }
        return out

    runs = occurrences(phases)
    out: dict[str, dict[str, Any]] = {}
    for name, labels in runs.items():
        if name != baseline:
            for a, b in occurrence_pairs(labels, runs[baseline]):
                out[f"{a}_over_{b}"] = entry(a, b)
    same = {f"{x}_over_{ls[0]}": entry(x, ls[0]) for ls in runs.values() for x in ls[1:]}
    largest = largest_a_a_distance(same)
    for pair in out.values():
        for key in KEYS:
            ratio, noise = pair[key]["ratio"], largest[key]
            within = None if ratio is None or noise is None else abs(ratio - 1.0) <= noise
            pair[key]["within_noise"] = within
    return out | same


def has_repeats(phases: Iterable[str]) -> bool:
    """Whether some phase among these labels ran more than once."""
    return any(len(labels) > 1 for labels in occurrences(phases).values())


def is_a_a(pair: str) -> bool:
    """``unified#2_over_unified`` is an A/A pair (both sides one phase); the rest are A/B."""
    a, _, b = pair.partition("_over_")
    return phase_of(a) == phase_of(b)


def largest_a_a_distance(comparisons: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per key, the largest |ratio - 1| over the A/A pairs among ``comparisons`` (None: no A/A
    pair with a ratio for that key)."""
    out: dict[str, float | None] = {}
    for key in KEYS:
        found = [
            abs(entry[key]["ratio"] - 1.0)
            for pair, entry in comparisons.items()
            if is_a_a(pair) and entry[key]["ratio"] is not None
        ]
        out[key] = max(found) if found else None
    return out


def noise_lines(comparisons: dict[str, dict[str, Any]]) -> list[str]:
    """The A/A spread and the A/B verdicts of one run's `compare_phases`, as printed lines
    (none without a repeat)."""
    same = [pair for pair in comparisons if is_a_a(pair)]
    if not same:
        return []
    largest = largest_a_a_distance(comparisons)
    lines = ["  same-run noise at equal batch (A/A: a repeat over its phase's first run):"]
    for pair in same:
        lines.append(f"    {pair:40s} " + _cells(comparisons[pair]))
    spread = "  ".join(
        f"{key} {'-' if largest[key] is None else f'{largest[key]:.4f}'}" for key in KEYS
    )
    lines.append(f"    largest A/A distance from 1.0: {spread}")
    lines.append(f"  {WITHIN_NOISE_RULE}; a phase's verdict is its first runs' pairing:")
    verdicts = {True: "within", False: "OUTSIDE", None: "-"}
    for pair, entry in comparisons.items():
        if not is_a_a(pair):
            cells = [
                f"{key} {entry[key]['ratio']:.4f} {verdicts[entry[key]['within_noise']]}"
                if entry[key]["ratio"]
                else f"{key} -"
                for key in KEYS
            ]
            lines.append(f"    {pair:40s} " + "  ".join(cells))
    return lines


def _cells(entry: dict[str, Any]) -> str:
    cells = []
    for key in KEYS:
        ratio, ci = entry[key]["ratio"], entry[key]["ci95"]
        interval = "" if ci is None else f" [{ci[0]:.4f}-{ci[1]:.4f}]"
        cells.append(f"{key} {ratio:.4f}{interval}" if ratio else f"{key} -")
    return "  ".join(cells)


def load_phases(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The `<result>.iterations.json` table as phase -> rows (dicts by column); a `.gz` file
    (how `bench/results/` keeps them) is read through gzip."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    table = json.loads(raw)
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
        "config": {
            "bin_width": args.bin_width,
            "min_count": args.min_count,
            "reps": args.reps,
            "within_noise": WITHIN_NOISE_RULE,
        },
        "files": {},
    }
    for path in args.iterations:
        comparisons = compare_phases(
            load_phases(path), bin_width=args.bin_width, min_count=args.min_count, reps=args.reps
        )
        result["files"][path.name] = comparisons
        print(path.name)
        width = max([36, *(len(pair) for pair in comparisons)])
        for pair, entry in comparisons.items():
            print(f"  {pair:{width}s} " + _cells(entry))
        for line in noise_lines(comparisons):
            print(line)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
