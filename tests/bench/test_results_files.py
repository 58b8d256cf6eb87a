"""The committed benchmark results stay small enough to travel with the tree: per-iteration
tables (`*.iterations.json`) are committed gzipped, and each one still reads back as JSON."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_iteration_tables_are_committed_gzipped_and_readable() -> None:
    plain = sorted(p.name for p in RESULTS.glob("*.iterations.json"))
    assert plain == [], f"gzip these before committing: {plain}"
    packed = sorted(RESULTS.glob("*.iterations.json.gz"))
    assert packed, "no per-iteration tables under bench/results"
    for path in packed:
        table = json.loads(gzip.decompress(path.read_bytes()))
        assert isinstance(table, dict) and table, path.name
        assert path.with_name(path.name.removesuffix(".iterations.json.gz") + ".json").exists()
