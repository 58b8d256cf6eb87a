"""What each GPU sharing mechanism costs on this GPU (green-context SM partitions vs streams).

Run on the GPU host: ``python -m bench.sharing --commit <sha> [--out DIR]``.
Writes ``sharing-<gpu>-<yyyymmdd>.json`` (bench/README.md layout) and prints a table last.

Workloads:
  * decode-like pass: 16 GEMMs ``x[64, 4096] @ W_i[4096, 14336]`` (bf16, 1.88 GB of distinct
    weights, far over the 60 MB L2): the memory-bound shape of a decode iteration.
  * finetune-like load: back-to-back ``8192^3`` bf16 GEMMs (compute-bound).
Figures: partition creation time; decode pass time/bandwidth per decode SM count alone; both
workloads side by side with a 48/84 or 72/60 split, with plain streams (priorities) and with none;
the cost of switching split every iteration; which SMs a CUDA graph replays on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from bench.sharing.args import parse_args
from bench.sharing.measure import beside_rows, graphs, solo_rows, switching, torch_green_context
from bench.sharing.report import build_result, print_report, result_path
from bench.sharing.setup import prepare_bench, probe


def _guard(notes: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """Run one section; record its failure in notes instead of losing the whole run."""
    try:
        value = fn()
    except Exception as exc:  # a broken section must not cost the other figures
        notes[key] = {"error": f"{type(exc).__name__}: {exc}"}
        return None
    notes[key] = value
    return value


def main() -> None:
    args = parse_args(__doc__)
    groups: tuple[int, ...] | None = args.groups
    if args.probe:
        probe(groups)
        return
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench.sharing measures SM partitions and streams on a CUDA GPU; "
            f"torch {torch.__version__} sees none"
        )
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    notes: dict[str, Any] = {}
    reps = args.reps
    sharing, fallback, w, full_ft, copy_tbs = prepare_bench(
        device, groups, props.multi_processor_count, notes
    )

    rows: list[dict[str, Any]] = []
    rows += (
        _guard(notes, "solo_status", lambda: solo_rows(sharing, w, copy_tbs, reps, full_ft)) or []
    )
    g_full = next(
        (
            r["gemm_ms_p50"]
            for r in rows
            if r["experiment"] == "gemm_alone" and r["mechanism"] == "streams"
        ),
        1.0,
    )
    rows += (
        _guard(
            notes,
            "beside_status",
            lambda: beside_rows(sharing, fallback, w, copy_tbs, reps, g_full),
        )
        or []
    )
    for key in ("solo_status", "beside_status"):
        if isinstance(notes[key], list):
            notes[key] = "ok"
    _guard(notes, "switch", lambda: switching(sharing, w))
    _guard(notes, "graphs", lambda: graphs(sharing, fallback, w, reps))
    sharing.close()

    result = build_result(
        args.commit, props.name, props.multi_processor_count, w.decode_bytes, reps, notes, rows
    )
    path = result_path(args.out, props.name)
    path.write_text(json.dumps(result, indent=1))
    # Last, since it pushes contexts: torch's own green context API on this version.
    _guard(notes, "torch_green_context", lambda: torch_green_context(w, reps))
    path.write_text(json.dumps(result, indent=1))
    print_report(notes, rows, path)
