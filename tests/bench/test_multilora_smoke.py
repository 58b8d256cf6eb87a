"""`bench/multilora/run.py` end to end on the tiny model on CPU, run as a user would: every mode on
both target sets at batch 2 with the mixed decode+prefill steps, the JSON it writes and the table
it prints last. On CPU there is no fused LoRA decode step, so each check records why it was
skipped (the GPU run records the comparison against the eager LoRA path)."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

import pytest

from gpu_runtime.contract.statistics import percentile
from tests.bench.script_runs import RESULT_HEAD, run_script

ROOT = Path(__file__).resolve().parent.parent.parent
MODES = ("shared+kernels", "shared", "separate")
TARGETS = ("qkvo", "all")
BATCH, CONTEXT, ADAPTERS, RANK, STEPS, WARMUP = 2, 16, 2, 4, 3, 1
TOP_KEYS = [*RESULT_HEAD, "checks", "rows", "wall_s"]
ROW_KEYS = {
    "model",
    "system",
    "targets",
    "mix",
    "adapter_rows",
    "graph_replay_ms_p50",
    "lora_targets",
    "mode",
    "batch",
    "context",
    "adapters",
    "lora_rank",
    "slot_mem_gb",
}
MIXED_STEP_SYSTEMS = ("harli_mixed_step", "harli_mixed_step_old")
CPU_CHECK = {
    "skipped": "no fused LoRA decode step on this device",
    "kernel_profiles": {},
    "captured": [],
    "capture_s": 0.0,
}


def _expected_rows(first_set: bool) -> list[tuple[str, str, int]]:
    """(system, mix, adapter rows) of one target set and mode, in the order the script writes
    them; the mixed decode+prefill steps are timed once, on the run's first set."""
    return [
        ("harli", "base", 0),
        *[(system, "base", 0) for system in MIXED_STEP_SYSTEMS if first_set],
        ("harli", "adapters", BATCH),
        ("harli_eager_lora", "adapters", BATCH),
        ("harli", "mixed", BATCH // 2),
    ]


@pytest.mark.slow
def test_tiny_cpu_run_writes_every_mode_and_mix_and_prints_the_table_last(
    tmp_path: Path,
) -> None:
    stdout, path = run_script(
        "multilora",
        [
            *("--model", "tiny", "--device", "cpu", "--batch", str(BATCH)),
            *("--context", str(CONTEXT), "--adapters", str(ADAPTERS), "--rank", str(RANK)),
            *("--steps", str(STEPS), "--warmup", str(WARMUP), "--mixed-steps"),
            *("--commit", "test"),
        ],
        tmp_path,
        "multilora",
        # one thread: tiny shapes on a shared machine only contend (`bench/finetune/run.py` sets it)
        env={"OMP_NUM_THREADS": "1"},
    )

    out = json.loads(path.read_text())
    assert list(out) == TOP_KEYS
    assert (out["name"], out["commit"], out["gpu"]) == ("multilora", "test", "cpu")
    assert out["torch"] and datetime.datetime.fromisoformat(out["created"])
    config = out["config"]
    assert (config["model"], config["batch"], config["modes"]) == ("tiny", BATCH, ",".join(MODES))
    assert (config["dtype"], config["block_size"], config["mixed_steps"]) == ("float32", 16, True)

    sets = [(mode, targets) for mode in MODES for targets in TARGETS]
    assert out["checks"] == {
        (targets if mode == MODES[0] else f"{targets}/{mode}"): CPU_CHECK for mode, targets in sets
    }
    rows = out["rows"]
    assert [
        (r["mode"], r["lora_targets"], r["system"], r["mix"], r["adapter_rows"]) for r in rows
    ] == [
        (mode, targets, *row)
        for mode, targets in sets
        for row in _expected_rows((mode, targets) == sets[0])
    ]
    for row in rows:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert (row["model"], row["batch"], row["context"]) == ("tiny", BATCH, CONTEXT)
        assert (row["adapters"], row["lora_rank"]) == (ADAPTERS, RANK)
        assert row["targets"] == ("-" if row["mix"] == "base" else row["lora_targets"])
        assert row["graph_replay_ms_p50"] is None  # no CUDA graphs on CPU
        assert row["slot_mem_gb"] >= 0
        if row["system"] == "harli_eager_lora":
            assert row["forward_ms_p50"] > 0
        else:
            assert row["tpot_ms_p99"] >= row["tpot_ms_p50"] > 0
    for mode, targets in sets:
        harli = [
            r
            for r in rows
            if (r["mode"], r["lora_targets"], r["system"]) == (mode, targets, "harli")
        ]
        base = harli[0]
        for row in harli:
            assert len(row["raw_step_ms"]) == STEPS and row["lora_graph_steps"] == 0
            assert row["tpot_ms_p50"] == statistics.median(row["raw_step_ms"])
            # interpolated between the two slowest of 3 (from the raw times, kept to 4 digits)
            p99 = percentile(row["raw_step_ms"], 99)
            assert row["tpot_ms_p99"] == pytest.approx(p99, abs=1e-4)
            expected = round(row["tpot_ms_p50"] / base["tpot_ms_p50"] - 1, 4)
            assert row["overhead_frac"] == pytest.approx(expected, abs=1e-4)
        assert base["overhead_frac"] == 0.0
    # `all` adapts every linear projection: its slots hold more than q/k/v/o's
    slot_mem = {r["lora_targets"]: r["slot_mem_gb"] for r in rows}
    assert slot_mem["all"] >= slot_mem["qkvo"]

    lines = stdout[stdout.index("\nwrote ") :].splitlines()[1:]
    # the run's wall time when it prints, after the file's last write
    wrote, seconds = lines[0].rsplit(" in ", 1)
    assert wrote == f"wrote {path}" and seconds.endswith(" s")
    assert float(seconds[:-2]) >= out["wall_s"] - 0.05
    assert lines[1].split() == [
        *("system", "targets", "mode", "mix", "p50", "ms"),
        *("graph", "ms", "overhead", "graph", "ovh"),
    ]
    # every number ends where its header ends, whatever the longest system name
    header = lines[1]
    ends = [header.index(h) + len(h) for h in ("p50 ms", "graph ms", "overhead", "graph ovh")]
    for line in lines[2 : 2 + len(rows)]:
        assert len(line) == ends[-1] and all(line[end - 1].isdigit() for end in ends)
        assert all(line[end] == " " for end in ends[:-1])
    table = [line.split() for line in lines[2 : 2 + len(rows)]]
    half_digit = 5.01e-4  # printed to 3 decimals: half a last digit, and float slack
    for cells, row in zip(table, rows, strict=True):
        assert cells[:4] == [row["system"], row["targets"], row["mode"], row["mix"]]
        assert float(cells[4]) == pytest.approx(row.get("tpot_ms_p50", 0.0), abs=half_digit)
        assert float(cells[5]) == pytest.approx(row.get("forward_ms_p50", 0.0), abs=half_digit)
        assert float(cells[6]) == pytest.approx(row.get("overhead_frac", 0.0), abs=half_digit)
    assert lines[2 + len(rows) :] == [
        f"check {name}: {check}" for name, check in out["checks"].items()
    ]


def test_result_file_is_named_like_every_bench_result(tmp_path: Path) -> None:
    from bench.multilora.report import result_path

    day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
    assert result_path(str(tmp_path), "NVIDIA H200").name == f"multilora-h200-{day}.json"
    # an unknown GPU keeps its whole name (its last word alone could name two different GPUs)
    named = result_path(str(tmp_path / "out"), "NVIDIA RTX 6000 Ada Generation")
    assert named.name == f"multilora-nvidia-rtx-6000-ada-generation-{day}.json"
    assert named.parent.is_dir()
