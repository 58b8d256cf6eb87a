"""The record of a ``bench/sharing/run.py`` run: its result JSON (``build_result``; the layout of
bench/README.md), the file it goes to (``result_path``: ``sharing-<gpu>-<yyyymmdd>.json``) and
the notes and table printed last (``print_report``)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import torch

from bench.common.provenance import commit_hash, gpu_slug
from bench.sharing.workloads import BIG, DECODE_BATCH, HIDDEN, INTER, N_WEIGHTS


def build_result(
    commit: str | None,
    gpu_name: str,
    sms: int,
    decode_bytes: int,
    reps: int,
    notes: dict[str, Any],
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run's JSON (``decode_bytes``: the bytes one decode pass moves, ``Workloads``'s);
    ``notes`` and ``rows`` are held, not copied, so later notes are in it."""
    return {
        "name": "sharing",
        "commit": commit or commit_hash(),
        "gpu": gpu_name,
        "torch": torch.__version__,
        "created": dt.datetime.now(dt.UTC).isoformat(),
        "config": {
            "decode_pass": f"{N_WEIGHTS}x [{DECODE_BATCH},{HIDDEN}]@[{HIDDEN},{INTER}]",
            "decode_bytes": decode_bytes,
            "big_gemm": BIG,
            "reps": reps,
            "sms": sms,
        },
        "notes": notes,
        "rows": rows,
    }


def result_path(out_dir: str, gpu_name: str) -> Path:
    """``<out_dir>/sharing-<gpu>-<yyyymmdd>.json`` (`provenance.gpu_slug`, as every bench names
    its file); creates ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"sharing-{gpu_slug(gpu_name)}-{dt.datetime.now(dt.UTC):%Y%m%d}.json"


def print_report(notes: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    """The notes as JSON, then one table line per row."""
    print(json.dumps(notes, indent=1))
    print(
        f"{'experiment':20} {'mech':13} {'dSM':>4} {'fSM':>4} {'bg':11} {'ms':>8} {'TB/s':>6}"
        f" {'TFLOP/s':>8}"
    )
    for r in rows:
        ms = r.get("decode_pass_ms_p50", r.get("gemm_ms_p50"))
        print(
            f"{r['experiment']:20} {r['mechanism']:13} {r['decode_sms']:4} "
            f"{r['finetune_sms']:4} {r.get('background', ''):11} {ms:8.3f} "
            f"{r.get('bandwidth_tbs', 0):6.2f} {r.get('gemm_tflops', 0):8.1f}"
        )
    print("wrote", path)
