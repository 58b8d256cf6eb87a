"""The profiler's command line end to end on CPU (``--device cpu``: the GPU run's code path,
wall-clock timings), with a deployment's engine configuration and chunked steps."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from predictor_models import profile
from predictor_models.dataset import load_profile


def test_cpu_dry_run_writes_both_stages_with_deployment_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [
        "profile",
        "--device=cpu",
        "--model=tiny",
        f"--out={tmp_path}",
        "--stages=12",
        "--stage1-s=1.5",
        "--stage2-s=1.5",
        "--iters=2",
        "--max-kv-tokens=32768",
        "--decode-groups=6,8,12",
        "--mixed-graphs",
        "--max-num-seqs=16",
        "--max-batched-tokens=128",
        "--graph-batch-sizes=1,2,4,8,12,16",
        "--max-model-len=512",
        "--context-max=300",
        "--chunk-share=0.5",
        "--prefix-share=0.5",
        "--two-chunk-share=0.3",
        "--decode-per-quantum=2",
        "--tag=dry",
        "--commit=abc",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    profile.main()
    stem = tmp_path / "profile-cpu-tiny-dry"
    meta = json.loads(stem.with_suffix(".meta.json").read_text())
    assert meta["errors"] == [] and meta["commit"] == "abc"
    assert meta["decode_sms_choices"] == [48, 64, 96, 132]
    assert meta["engine"]["graph_batch_sizes"] == [1, 2, 4, 8, 12, 16]
    assert meta["engine"]["mixed_graph_token_sizes"] == [64, 128]
    assert meta["engine"]["chunk_attention"] == "varlen"  # the engine's default
    assert meta["step_space"]["chunk_share"] == 0.5
    assert meta["stage2_step_space"]["chunk_share"] == 0.0
    rows = list(csv.DictReader(stem.with_suffix(".csv").read_text().splitlines()))
    stage1 = [r for r in rows if r["stage"] == "1"]
    stage2 = [r for r in rows if r["stage"] == "2"]
    assert stage1 and stage2
    for row in rows:
        batch, prefill = int(float(row["batch_size"])), int(float(row["prefill_chunk_tokens"]))
        assert batch <= 16 and batch + prefill <= 128
        padded = int(row["padded_tokens"])
        if prefill:
            assert padded == (64 if batch + prefill <= 64 else 128)
        else:
            assert padded == next(b for b in (1, 2, 4, 8, 12, 16) if b >= batch)
    assert all(float(r["prefill_chunk_tokens"]) == 0 for r in stage2)
    assert all(float(r["ft_tokens"]) > 0 for r in stage2)
    data = load_profile(stem.with_suffix(".csv"))  # the training loader reads it
    assert len(data) == len(rows)
