"""`python -m bench.memory mechanism`: the CUDA virtual-memory facts the pool is built on (see
`run.py` for what it measures). The result rows (`Recorder`), the caching-allocator
costs (measured in a fresh process per allocator mode: `python -m bench.memory allocator`), the
run and its table; the driver, view, in-flight, usable-at-once and move measurements are
`mechanism_checks.py`, the rows `recorder.py`."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.provenance import ROOT, commit_hash, gpu_slug
from bench.memory.mechanism_checks import (
    driver_costs,
    in_flight,
    move_one_gib,
    usable_at_once,
    view_correctness,
)
from bench.memory.recorder import GIB, MIB, PAGE, Recorder


# ---- caching allocator: flush and refill, default vs expandable segments ------------------
def allocator_costs() -> dict[str, Any]:
    """Run in a fresh process (the allocator mode is fixed at CUDA init): a finetune-like
    pattern of ~5 GiB in mixed sizes, freed; then empty_cache, cold refill, warm refill."""
    import random

    import torch

    rng = random.Random(0)
    sizes = [rng.randint(1, 32) * MIB + rng.randint(0, 4095) for _ in range(300)]

    def fill() -> list[torch.Tensor]:
        tensors = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
        torch.cuda.synchronize()
        return tensors

    fill()  # warm up the CUDA context
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    start = time.perf_counter()
    tensors = fill()
    out["cold_fill_ms"] = (time.perf_counter() - start) * 1e3
    out["allocated_gib"] = torch.cuda.memory_allocated() / GIB
    out["reserved_gib"] = torch.cuda.memory_reserved() / GIB
    # Keep a tenth alive (LoRA state), free the rest: how much does a flush give back?
    keep = tensors[::10]
    del tensors
    start = time.perf_counter()
    torch.cuda.empty_cache()
    out["empty_cache_ms"] = (time.perf_counter() - start) * 1e3
    out["kept_allocated_gib"] = torch.cuda.memory_allocated() / GIB
    out["reserved_after_flush_gib"] = torch.cuda.memory_reserved() / GIB
    del keep
    torch.cuda.empty_cache()
    tensors = fill()
    del tensors
    start = time.perf_counter()
    fill()
    out["warm_fill_ms"] = (time.perf_counter() - start) * 1e3
    return out


def _allocator(rec: Recorder) -> None:
    for conf in ("", "expandable_segments:True"):
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        proc = subprocess.run(
            [sys.executable, "-m", "bench.memory", "allocator"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        mode = "expandable" if conf else "default"
        for key, value in result.items():
            if key != "alloc_conf":
                unit = "ms" if key.endswith("_ms") else "GiB"
                rec.value("allocator", key, value, unit, allocator=mode)


def mechanism(out_dir: Path) -> Path:
    import torch

    rec = Recorder()
    props = torch.cuda.get_device_properties(0)
    rec.run("driver", lambda: driver_costs(rec))
    rec.run("view", lambda: view_correctness(rec))
    rec.run("in_flight", lambda: in_flight(rec))
    rec.run("usable", lambda: usable_at_once(rec))
    rec.run("move", lambda: move_one_gib(rec))
    rec.run("allocator", lambda: _allocator(rec))
    try:
        from importlib.metadata import version

        bindings = version("cuda-bindings")
    except Exception:
        bindings = "unknown"
    today = dt.datetime.now(dt.UTC)
    result = {
        "name": "memory-mechanism",
        "commit": commit_hash(),
        "gpu": props.name,
        "torch": torch.__version__,
        "created": today.isoformat(timespec="seconds"),
        "config": {
            "page_bytes": PAGE,
            "cuda_bindings": bindings,
            "total_memory_bytes": props.total_memory,
            "driver_pages_per_round": 512,
            "driver_rounds": 3,
        },
        "rows": rec.rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"memory-mechanism-{gpu_slug(props.name)}-{today:%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=1))
    _print_table(rec.rows)
    return path


def _print_table(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if "check" in row:
            flag = "PASS" if row["passed"] else "FAIL"
            print(f"{flag:6} {row['section']:10} {row['check']}  {row.get('detail', '')}")
    for row in rows:
        if "measure" in row:
            tag = row.get("allocator", "") or (
                f"{row['chunk_mib']} MiB" if "chunk_mib" in row else ""
            )
            name = f"{row['section']:10} {row['measure']:34} {tag:10}"
            print(f"{name} {row['value']:12.3f} {row['unit']}")
