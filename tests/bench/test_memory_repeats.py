"""`python -m bench.memory trace` with a phase given more than once: the labels of its repeats, the
command line's errors, the comparisons keyed by label, and a repeated run on the tiny model on
CPU whose repeats are configured as their first runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.memory.args import (
    occurrence_of,
    occurrence_pairs,
    occurrences,
    parse_phases,
    phase_labels,
    phase_of,
)
from bench.memory.run import main
from bench.memory.trace_report import trace_comparisons
from tests.bench.memory_runs import run_tiny_trace


def test_a_repeated_phase_is_labelled_by_its_run() -> None:
    names = parse_phases("static_split,unified_release,static_split,unified_release,static_split")
    labels = phase_labels(names)
    assert labels == [
        "static_split",
        "unified_release",
        "static_split#2",
        "unified_release#2",
        "static_split#3",
    ]
    assert [phase_of(label) for label in labels] == names
    assert [occurrence_of(label) for label in labels] == [1, 1, 2, 2, 3]
    assert phase_labels(["unified", "static_split"]) == ["unified", "static_split"]
    assert occurrences(["unified#2", "static_split", "unified"]) == {
        "unified": ["unified", "unified#2"],
        "static_split": ["static_split"],
    }
    # the runs of the same rank first, then the crossed ones
    assert occurrence_pairs(["u", "u#2"], ["s", "s#2"]) == [
        ("u", "s"),
        ("u#2", "s#2"),
        ("u", "s#2"),
        ("u#2", "s"),
    ]
    assert occurrence_pairs(["u"], ["s"]) == [("u", "s")]
    assert occurrence_pairs(["u"], []) == []


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ("unified,static", "unknown phases ['static']"),
        (",", "no phase given"),
        ("", "no phase given"),
        ("static_split,unified#2", "carry '#', which marks a repeat"),
    ],
)
def test_a_bad_phase_list_is_the_parsers_error(
    phases: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "--model=tiny", "--device=cpu", f"--phases={phases}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "argument --phases:" in error and message in error


def _row(policy: str, p50: float, ci: list[float], tps: float) -> dict:
    return {
        "policy": policy,
        "decode_iter_ms_p50": p50,
        "decode_iter_ms_p99": 2 * p50,
        "pure_decode_iter_ms_p50": p50,
        "decode_iter_ms_p50_ci95": ci,
        "mean_borrowed_gb": 10.0,
        "finetune_tokens_per_s": tps,
        "reclaim_ms_p99": 1.0,
    }


def test_comparisons_pair_every_run_and_each_repeat_with_its_first() -> None:
    rows = [
        _row("static_split", 10.0, [9.9, 10.1], 100.0),
        _row("unified_release", 10.2, [10.15, 10.3], 120.0),
        _row("static_split#2", 10.1, [10.0, 10.2], 100.0),
        _row("unified_release#2", 10.4, [10.35, 10.45], 121.0),
    ]
    out = trace_comparisons(rows)
    # the keys a run without repeats has, unchanged
    assert out["decode_iter_ms_p50_ratio_unified_release_over_static_split"] == pytest.approx(1.02)
    assert out["decode_iter_ms_p50_ci95_overlap_unified_release_static_split"] is False
    ratio = "decode_iter_ms_p50_ratio_unified_release#2_over_static_split#2"
    assert out[ratio] == pytest.approx(10.4 / 10.1)
    assert "finetune_tokens_per_s_ratio_unified_release#2_over_static_split" in out
    assert out["reclaim_ms_p99_over_decode_iter_ms_p50_unified_release#2"] == pytest.approx(
        1 / 10.4
    )
    # A/A: each repeat over its phase's first run, finetune figures included
    assert out["decode_iter_ms_p50_ratio_static_split#2_over_static_split"] == pytest.approx(1.01)
    assert out["decode_iter_ms_p50_ci95_overlap_static_split#2_static_split"] is True
    assert out["finetune_tokens_per_s_ratio_unified_release#2_over_unified_release"] == 121 / 120
    assert out["decode_iter_ms_p50_ci95_overlap_unified_release#2_unified_release"] is False
    assert not [key for key in out if "static_split_over_static_split#2" in key]
    # without repeats: the keys of before, nothing labelled
    single = trace_comparisons(rows[:2])
    assert not [key for key in single if "#" in key]
    assert set(single) < set(out)


@pytest.mark.slow
def test_a_repeated_phase_runs_again_as_it_first_ran(tmp_path: Path) -> None:
    """static_split first takes decode alone's given KV peak (120 blocks, one page each on CPU)
    plus the reserve; `unified` then measures its own peak, which static_split's repeat must
    not take, nor unified's peak prior (static_split's first run read none). The given peak is
    far above what this trace reaches (34-40 blocks), so the two cannot coincide by chance
    (a given 40 could)."""
    run = run_tiny_trace(
        tmp_path,
        "--job-pool-extra-gib=1",
        "--decode-only-kv-peak-blocks=120",
        "--phases=static_split,unified,static_split,unified",
    )
    result = run.result
    labels = ["static_split", "unified", "static_split#2", "unified#2"]
    rows = {row["policy"]: row for row in result["rows"]}
    assert list(rows) == labels
    for row in rows.values():
        assert "error" not in row and row["decode_iterations"] > 0 and row["finetune_quanta"] > 0
    config = result["config"]
    assert config["phases"] == "static_split,unified,static_split,unified"
    settings = config["phase_settings"]
    assert list(settings) == labels
    assert settings["static_split"] == {
        "pool_gib": 0.05,
        "plan_peak_prior_blocks": 0,
        "static_decode_pages": 120 + 16,
    }
    assert settings["unified"] == {"pool_gib": 0.05, "plan_peak_prior_blocks": 120}
    assert settings["static_split#2"] == settings["static_split"]
    assert settings["unified#2"] == settings["unified"]
    # what static_split#2 would have taken from unified's run: a different share
    assert rows["unified"]["kv_peak_pages"] + 16 != 120 + 16
    # the share decides what the static split lends finetuning, the same in both runs
    assert rows["static_split#2"]["max_borrowed_gb"] == rows["static_split"]["max_borrowed_gb"]
    assert config["pool_gib_per_phase"] == {label: 0.05 for label in labels}
    # one iteration list per run, keyed by label
    table = json.loads(run.path.with_suffix(".iterations.json").read_text())
    assert list(table["phases"]) == labels
    for label in labels:
        assert len(table["phases"][label]) == rows[label]["iterations"]
    assert table["phases"]["static_split"] != table["phases"]["static_split#2"]
    comparisons = result["comparisons"]
    assert "decode_iter_ms_p50_ratio_unified#2_over_unified" in comparisons
    equal = comparisons["equal_batch"]
    assert list(equal) == [
        "unified_over_static_split",
        "unified#2_over_static_split#2",
        "unified_over_static_split#2",
        "unified#2_over_static_split",
        "static_split#2_over_static_split",
        "unified#2_over_unified",
    ]
    assert comparisons["equal_batch_within_noise_rule"].startswith("within_noise:")
    # each verdict is the rule applied to the run's own figures: none where the tiny CPU trace
    # left too few iterations per batch bin for a ratio (it varies with the machine's timing;
    # the rule itself is tested on synthetic phases in test_memory_equal_batch.py)
    for key in ("iteration_ms", "step_ms", "wait_ms"):
        aa = [
            equal[p][key]["ratio"]
            for p in ("static_split#2_over_static_split", "unified#2_over_unified")
        ]
        spread = [abs(r - 1.0) for r in aa if r is not None]
        ab = equal["unified_over_static_split"][key]
        expected = (
            None if ab["ratio"] is None or not spread else abs(ab["ratio"] - 1.0) <= max(spread)
        )
        assert ab["within_noise"] == expected
    assert equal["unified_over_static_split"]["wait_ms"]["within_noise"] is None  # CPU: no wait
    # the table printed last shows the repeats, then the A/A spread
    out = run.stdout
    assert "\nstatic_split#2 " in out and "\nunified#2 " in out
    assert "static_split#2 over static_split: " in out
    assert "largest A/A distance from 1.0: " in out
    assert out.strip().splitlines()[-1].startswith("wrote ")
