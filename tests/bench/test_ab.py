"""`python -m bench.ab`: a benchmark package run alternately in two trees and merged. On CPU the
multilora package's tiny run stands in for any package; both trees are this checkout (an A/A
run), so every configuration appears in both and its ratio is measured, not assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ab.merge import merge_runs
from tests.bench.script_runs import ROOT, run_script

KEYS = ["model", "system", "lora_targets", "mode", "mix"]


def _document(run_rows: list[tuple[str, float]]) -> dict[str, object]:
    return {"rows": [{"model": m, "tpot_ms_p50": t} for m, t in run_rows]}


def test_merge_gives_mean_ratio_and_spread_per_configuration() -> None:
    documents = {
        "new1": _document([("a", 2.0), ("b", 4.0)]),
        "old1": _document([("a", 4.0), ("b", 4.0)]),
        "new2": _document([("a", 2.2), ("b", 4.0)]),
        "old2": _document([("a", 4.4)]),
    }
    rows, ratios = merge_runs(documents, keys=["model"], figures=["tpot_ms_p50"])
    assert [(r["run"], r["tree"], r["model"]) for r in rows] == [
        ("new1", "new", "a"), ("new1", "new", "b"), ("old1", "old", "a"),
        ("old1", "old", "b"), ("new2", "new", "a"), ("new2", "new", "b"), ("old2", "old", "a"),
    ]  # fmt: skip
    by_model = {r["model"]: r for r in ratios}
    assert by_model["a"] == {
        "model": "a",
        "figure": "tpot_ms_p50",
        "new_mean": 2.1,
        "old_mean": 4.2,
        "ratio": 0.5,
        "aa_spread_new": 0.1,
        "aa_spread_old": 0.1,
    }
    assert (by_model["b"]["ratio"], by_model["b"]["aa_spread_old"]) == (1.0, 0.0)


def test_merge_refuses_a_key_that_does_not_identify_one_row() -> None:
    documents = {"new1": _document([("a", 1.0), ("a", 2.0)])}
    with pytest.raises(ValueError, match="two rows share"):
        merge_runs(documents, keys=["model"], figures=["tpot_ms_p50"])


@pytest.mark.slow
def test_alternating_run_of_a_package_in_two_trees(tmp_path: Path) -> None:
    stdout, path = run_script(
        "ab",
        [
            *("--before-tree", str(ROOT), "--before-commit", "same", "--runs", "2"),
            *("--key", ",".join(KEYS), "--figure", "tpot_ms_p50,tpot_ms_p99"),
            "--package-args",
            "--model tiny --device cpu --batch 2 --context 16 --adapters 2 --rank 4 --steps 2 "
            "--warmup 1",
            "multilora",
        ],
        tmp_path,
        "multilora-ab",
        env={"OMP_NUM_THREADS": "1"},
    )
    out = json.loads(path.read_text())
    assert out["config"]["order"] == ["new1", "old1", "new2", "old2"]
    assert out["config"]["before_commit"] == "same"
    assert {r["run"] for r in out["rows"]} == {"new1", "old1", "new2", "old2"}
    first = [r for r in out["rows"] if r["run"] == "new1"]
    expected = [
        (*(r[k] for k in KEYS), f) for f in ("tpot_ms_p50", "tpot_ms_p99") for r in first if f in r
    ]
    assert len(first) > 0 and len(expected) > len(first)
    assert sorted((*(r[k] for k in KEYS), r["figure"]) for r in out["ratios"]) == sorted(expected)
    for ratio in out["ratios"]:
        assert ratio["ratio"] == pytest.approx(ratio["new_mean"] / ratio["old_mean"], rel=1e-3)
    assert stdout.splitlines()[-1] == f"wrote {path}"


def test_the_result_file_is_found_beside_its_companions(tmp_path: Path) -> None:
    from bench.ab.__main__ import result_file

    (tmp_path / "colocate-h200-20261204.json").write_text("{}")
    (tmp_path / "colocate-h200-20261204.iterations.json").write_text("{}")
    (tmp_path / "colocate-h200-20261204.meta.json").write_text("{}")
    assert result_file(tmp_path, ["x"]).name == "colocate-h200-20261204.json"
    (tmp_path / "other-h200-20261204.json").write_text("{}")
    with pytest.raises(RuntimeError, match="wrote 2 result files"):
        result_file(tmp_path, ["x"])
