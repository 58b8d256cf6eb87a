"""`bench/finetune/run.py` end to end on the tiny model on CPU, run as a user would: our trainer and
HF + PEFT at seq 16, micro-batch 1 and 2, then its multi-LoRA decode part (through
`bench/multilora/run.py`'s `run_multilora`); the JSON it writes and the tables it prints last."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from tests.bench.script_runs import RESULT_HEAD, run_script

ROOT = Path(__file__).resolve().parent.parent.parent
SEQ, MICROS, RANK, STEPS, WARMUP = 16, (1, 2), 4, 3, 1
TOP_KEYS = [
    *RESULT_HEAD,
    "rows",
    "multi_lora_decode",
    "ratios",
    "graph_gains",
    "wall_s",
]
# bench/README.md: the row keys of a `finetune` result
ROW_KEYS = {
    "model",
    "system",
    "seq_len",
    "micro_batch",
    "lora_rank",
    "tokens_per_s",
    "peak_mem_gb",
}
# per target set, in the order `multi_lora_decode` returns them
DECODE_SYSTEMS = [
    ("harli_base", "base", 0),
    ("harli_multi_lora_adapters", "adapters", 32),
    ("harli_eager_lora", "adapters", 32),
    ("harli_multi_lora_mixed", "mixed", 16),
]
CPU_CHECK = {  # no fused LoRA decode step on CPU: the check says so instead of passing
    "skipped": "no fused LoRA decode step on this device",
    "kernel_profiles": {},
    "captured": [],
    "capture_s": 0.0,
}


@pytest.mark.slow
def test_tiny_cpu_run_writes_rows_decode_rows_and_prints_the_tables_last(tmp_path: Path) -> None:
    stdout, path = run_script(
        "finetune",
        [
            *("--model", "tiny", "--device", "cpu", "--targets", "qkvo", "--seq", str(SEQ)),
            *("--micro", ",".join(map(str, MICROS)), "--rank", str(RANK)),
            *("--steps", str(STEPS), "--warmup", str(WARMUP)),
            *("--commit", "test"),
        ],
        tmp_path,
        "finetune",
    )

    out = json.loads(path.read_text())
    assert list(out) == TOP_KEYS
    assert (out["name"], out["commit"], out["gpu"]) == ("finetune", "test", "cpu")
    assert out["torch"] and datetime.datetime.fromisoformat(out["created"])
    config = out["config"]
    assert (config["model"], config["seq"], config["micro"], config["rank"]) == (
        "tiny",
        str(SEQ),
        "1,2",
        RANK,
    )
    assert config["no_decode"] is False
    assert config["lora"].startswith(f"rank {RANK}, alpha {2 * RANK}, dropout 0.05;")
    assert config["model_config"]["hidden_size"] == 64 and config["base_weights_gb"] > 0

    rows = out["rows"]
    assert [(r["system"], r["micro_batch"]) for r in rows] == [
        (system, micro) for micro in MICROS for system in ("harli", "hf_peft")
    ]
    for row in rows:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["status"] == "ok", row["status"]
        assert (row["model"], row["targets"], row["seq_len"], row["lora_rank"]) == (
            "tiny",
            "qkvo",
            SEQ,
            RANK,
        )
        assert row["tokens_per_s"] > 0
        # tokens/s is the micro-batch's tokens over the median step (step_ms_p50 is rounded)
        step_s = row["step_ms_p50"] / 1e3
        assert row["tokens_per_s"] == pytest.approx(row["micro_batch"] * SEQ / step_s, rel=0.01)
        assert row["step_ms_p99"] >= row["step_ms_p50"] > 0
        assert row["peak_mem_gb"] == 0.0  # no peak counter on CPU
        assert 0 < row["last_loss"] and 0 < row["first_loss"] < 2 * 6.3  # ~ln(512) at B = 0
    harli = [r for r in rows if r["system"] == "harli"]
    assert all(r["graph_modes"] == ["off"] * (WARMUP + STEPS) for r in harli)  # no graphs on CPU
    assert all(r["host_ms_p50"] > 0 and r["graph_fallback"] is None for r in harli)
    # adapters start at B = 0: HF + PEFT's first loss is ours (its fresh model: micro-batch 1)
    assert rows[1]["first_loss_rel_diff"] < 1e-4
    assert rows[1]["first_loss"] == pytest.approx(rows[0]["first_loss"], rel=1e-4)
    assert "first_loss_rel_diff" not in rows[3]  # reused HF adapters were trained by row 2
    assert rows[1]["extra_mem_on_decode_gpu_gb"] == round(config["base_weights_gb"], 3)

    assert [(r["micro_batch"], r["speedup"]) for r in out["ratios"]] == [
        (micro, round(ours["tokens_per_s"] / ref["tokens_per_s"], 3))
        for micro, ours, ref in ((1, rows[0], rows[1]), (2, rows[2], rows[3]))
    ]
    assert out["graph_gains"] == []  # no harli_eager rows asked for

    decode = out["multi_lora_decode"]
    assert [(r["lora_targets"], r["system"], r["mix"], r["adapter_rows"]) for r in decode] == [
        (targets, *system) for targets in ("qkvo", "all") for system in DECODE_SYSTEMS
    ]
    for row in decode:
        assert (row["batch"], row["adapters"], row["lora_rank"]) == (32, 8, RANK)
        assert row["context"] == 512 - 5 - 2 * 50 - 48  # capped by the tiny model's positions
        assert row["mode"] == "shared+kernels"
        if row["system"] == "harli_eager_lora":
            assert row["forward_ms_p50"] > 0
            continue
        assert row["step_ms_p50"] == row["tpot_ms_p50"] > 0
        assert len(row["raw_step_ms"]) == 50 and row["cuda_graph"] is False
        assert row["check"] == (None if row["mix"] == "base" else CPU_CHECK)
    base = {r["lora_targets"]: r["tpot_ms_p50"] for r in decode if r["mix"] == "base"}
    for row in decode:
        if "overhead_frac" in row:
            expected = round(row["tpot_ms_p50"] / base[row["lora_targets"]] - 1, 4)
            assert row["overhead_frac"] == pytest.approx(expected, abs=1e-4)

    lines = stdout[stdout.index("\nwrote ") :].splitlines()[1:]
    assert lines[0] == f"wrote {path} in {out['wall_s']} s"
    assert lines[1].split() == [
        *("targets", "seq", "mb", "system", "tok/s", "step", "ms"),
        *("peak", "GB", "extra", "GB", "loss0"),
    ]
    table = [line.split() for line in lines[2 : 2 + len(rows)]]
    for cells, row in zip(table, rows, strict=True):
        assert cells[:4] == ["qkvo", str(SEQ), str(row["micro_batch"]), row["system"]]
        assert len(cells) == 9
        assert float(cells[4]) == pytest.approx(row["tokens_per_s"], abs=0.501)
        assert float(cells[8]) == pytest.approx(row["first_loss"], abs=5.01e-4)
    speedups = lines[2 + len(rows) : 4 + len(rows)]
    assert [line.split(":")[0] for line in speedups] == [
        f"speedup qkvo seq {SEQ} mb {m}" for m in MICROS
    ]
    for line, ratio in zip(speedups, out["ratios"], strict=True):
        assert ratio["peak_mem_ratio"] is None  # HF's peak on the CPU: no counter, no ratio
        assert f"peak mem n/a, extra mem on a decode GPU {ratio['extra_mem_ratio']}x" in line
    decode_lines = lines[4 + len(rows) :]
    assert len(decode_lines) == len(decode)  # one per decode row, and nothing after
    for line, row in zip(decode_lines, decode, strict=True):
        if row["system"] == "harli_eager_lora":
            assert line.split()[:7] == [
                *("decode", "batch", "32", "harli_eager_lora"),
                *("adapters", "8", row["lora_targets"]),
            ]
            assert line.endswith(f"forward {row['forward_ms_p50']:.3f} ms (eager)")
        else:
            assert line.split()[:4] == ["decode", "batch", "32", row["system"]]
            assert line.endswith("graph=False")
