"""The rows of alternating runs of two trees, merged: every run's rows tagged with `run` and
`tree`, and one ratio row per configuration and figure."""

from __future__ import annotations

from statistics import fmean
from typing import Any

Key = tuple[Any, ...]


def merge_runs(
    documents: dict[str, dict[str, Any]], *, keys: list[str], figures: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`documents` by run name (`new1`, `old1`, ...). Returns (rows, ratios): the runs' rows with
    `run` and `tree` added, and per configuration (the `keys` of a row) and figure present in
    both trees: `new_mean`, `old_mean`, `ratio` (new / old) and `aa_spread_new`,
    `aa_spread_old` (max / min - 1 over one tree's runs; 0 with one run). ValueError when two
    rows of one run share their `keys`."""
    rows: list[dict[str, Any]] = []
    values: dict[tuple[Key, str, str], list[float]] = {}
    for run, document in documents.items():
        tree = run.rstrip("0123456789")
        seen: set[Key] = set()
        for row in document.get("rows", []):
            rows.append({"run": run, "tree": tree, **row})
            key = tuple(row.get(k) for k in keys)
            if key in seen:
                raise ValueError(
                    f"{run}: two rows share {dict(zip(keys, key, strict=True))}: "
                    f"the key fields {keys} must identify one row"
                )
            seen.add(key)
            for figure in figures:
                value = row.get(figure)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    values.setdefault((key, figure, tree), []).append(float(value))
    ratios = []
    for (key, figure, tree), new in values.items():
        if tree != "new" or (key, figure, "old") not in values:
            continue
        old = values[(key, figure, "old")]
        ratios.append(
            {
                **dict(zip(keys, key, strict=True)),
                "figure": figure,
                "new_mean": round(fmean(new), 4),
                "old_mean": round(fmean(old), 4),
                "ratio": round(fmean(new) / fmean(old), 4) if fmean(old) else None,
                "aa_spread_new": _spread(new),
                "aa_spread_old": _spread(old),
            }
        )
    return rows, ratios


def _spread(samples: list[float]) -> float:
    low = min(samples)
    return round(max(samples) / low - 1.0, 4) if low > 0 else 0.0


def print_ratios(ratios: list[dict[str, Any]], *, keys: list[str]) -> None:
    """The ratio table, one line per configuration and figure."""
    header = [*keys, "figure", "new", "old", "ratio", "A/A new", "A/A old"]
    print(" | ".join(header))
    for r in ratios:
        cells = [str(r[k]) for k in keys]
        cells += [r["figure"], str(r["new_mean"]), str(r["old_mean"]), str(r["ratio"])]
        cells += [str(r["aa_spread_new"]), str(r["aa_spread_old"])]
        print(" | ".join(cells))
