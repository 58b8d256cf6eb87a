"""bench/memory/host_hooks.py on CPU, small: both policies run, every hook is timed, the figures are
written, and the two policies behave as their configurations say (a static split never
reclaims; unified lends the idle pool and takes pages back as decode grows)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.memory.host_hooks import BACKEND_READS, HOOKS, main


def test_memory_host_runs_both_policies_and_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    result = main(
        [
            "--iterations",
            "60",
            "--warmup",
            "5",
            "--batch",
            "8",
            "--output-len",
            "120",
            "--pool-pages",
            "4096",
            "--quantum-iterations",
            "5",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["policies"]
    assert set(rows) == {"static_split", "unified"}
    for row in rows.values():
        for hook in ("before_decode", "budget_read", "after_decode", "step"):
            assert row[f"{hook}_us_mean"] > 0
        assert set(HOOKS) <= {k.rsplit("_us_", 1)[0] for k in row if "_us_" in k}
        # after_decode's cap read and the budget read, every iteration
        assert row["finetune_reserved_bytes_per_iteration"] >= 2
        assert all(f"{name}_per_iteration" in row for name in BACKEND_READS)
        assert row["counters"]["iterations"] == 65
        assert 0 < row["quiet_iterations"] <= 60
        assert row["counters"]["finetune_quanta"] >= 10
        assert row["counters"]["finetune_budget_violations"] == 0
        assert row["counters"]["preemptions"] == 0
    static, unified = rows["static_split"]["counters"], rows["unified"]["counters"]
    assert static["finetune_shrinks"] == 0 and static["refill_maps"] == 0
    assert unified["finetune_grows"] >= 1
    assert rows["unified"]["usable_blocks_end"] < rows["static_split"]["usable_blocks_end"]
