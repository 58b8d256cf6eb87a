"""`python -m bench.memory trace` with a budget too small for one example without activation
recomputation under the static split, and room for it under the unified pool: the static split
recomputes every quantum, the unified phases none (tiny model on CPU, where budgets are
accounting: 64 KiB per token without recomputation, 16 with)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.bench.memory_runs import run_tiny_trace


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    # 0.05 GiB pool of 8 KiB CPU pages; the static split keeps 3000 + 16 for decode, so
    # finetuning gets ~27.6 MiB: one 512-token example is estimated at 36.4 MiB without
    # recomputation (64 KiB / token / 0.9) and 9.1 MiB with it. Unified lends ~45 MiB.
    flags = ("--static-kv-peak-blocks=3000", "--ft-seq-len=512", "--max-examples=1")
    return run_tiny_trace(tmp_path, *flags, *extra).result


@pytest.mark.slow
def test_the_static_split_recomputes_where_the_unified_pool_does_not(tmp_path: Path) -> None:
    result = _run(tmp_path, "--phases=static_split,unified,unified_release")
    finetune = result["config"]["finetune"]
    assert finetune["recompute"] == "auto" and finetune["recompute_bytes_per_token"] == 16384
    rows = {row["policy"]: row for row in result["rows"]}
    static = rows["static_split"]
    assert "error" not in static and static["finetune_quanta"] > 0
    assert static["finetune_recompute_quanta"] == static["finetune_quanta"]
    assert static["finetune_quantum_shapes"] == {"1r": static["finetune_quanta"]}
    assert static["counters"]["finetune_recompute_launches"] == static["finetune_quanta"]
    assert [q[0] for q in static["finetune_warmup"]["quanta"]] == ["1r", "1r"]
    for name in ("unified", "unified_release"):
        row = rows[name]
        assert "error" not in row and row["finetune_quanta"] > 0
        assert row["finetune_recompute_quanta"] == 0
        assert row["finetune_quantum_shapes"] == {"1": row["finetune_quanta"]}
        assert row["counters"]["finetune_recompute_launches"] == 0
        assert row["ooms"] == 0 and row["dropped_requests"] == 0
    assert rows["unified_release"]["finetune_warmup"]["shared_pool_shapes"] == ["1"]
    assert "finetune_recompute_quanta" in result["rows"][0]


@pytest.mark.slow
def test_without_recomputation_the_static_split_cannot_train(tmp_path: Path) -> None:
    result = _run(tmp_path, "--phases=static_split", "--recompute=never")
    (static,) = result["rows"]
    assert result["config"]["finetune"]["recompute_bytes_per_token"] is None
    assert static["finetune_quanta"] == 0 and static["finetune_paused_iterations"] > 0
    assert static["finetune_warmup"]["quanta"] == []
