"""The measurements of ``bench/sharing/run.py``, one function per figure: the decode pass alone at
every decode SM count and the big GEMM alone (``solo_rows``), both at once under each mechanism
(``beside_rows``), the cost of switching split every iteration (``switching``), where a CUDA
graph replays (``graphs``) and torch's own green context API (``torch_green_context``). Each
takes the partitions and workloads ``bench/sharing/setup.py`` prepared and returns its rows or
figures; failures propagate to the caller, which records them."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.common.samples import sample_percentile
from bench.sharing.workloads import Workloads, time_beside, time_on
from gpu_runtime.sharing import SmPartitioner, StreamSharing


def _decode_row(
    decode_bytes: int,
    copy_tbs: float,
    experiment: str,
    mech: str,
    dsms: int,
    fsms: int,
    bg: str,
    times: list[float],
) -> dict[str, Any]:
    """One decode-pass row from per-call ``times`` (ms; the first 3 are warm-up), with the
    pass's ``decode_bytes`` over its median as bandwidth, and that over ``copy_tbs``."""
    p50 = statistics.median(times[3:])
    return {
        "experiment": experiment,
        "mechanism": mech,
        "decode_sms": dsms,
        "finetune_sms": fsms,
        "background": bg,
        "decode_pass_ms_p50": p50,
        "decode_pass_ms_p99": sample_percentile(times[3:], 99),
        "bandwidth_tbs": decode_bytes / p50 / 1e9,
        "bandwidth_frac": decode_bytes / p50 / 1e9 / copy_tbs,
    }


def solo_rows(
    sharing: SmPartitioner, w: Workloads, copy_tbs: float, reps: int, full_ft: torch.cuda.Stream
) -> list[dict[str, Any]]:
    """Decode pass alone at every decode SM count; the big GEMM alone on finetune sides."""
    rows = []
    for k in sharing.table.choices:
        ds, fs = sharing.partition(k)
        info = sharing.info(k)
        rows.append(
            _decode_row(
                w.decode_bytes,
                copy_tbs,
                "decode_alone",
                "green_context" if info.spatial else "streams",
                k,
                info.finetune_sms,
                "none",
                time_on(ds, w.decode_pass, reps),
            )
        )
        if info.spatial and k in (48, 72):
            g = statistics.median(time_on(fs, w.big_gemm, 10)[2:])
            rows.append(
                {
                    "experiment": "gemm_alone",
                    "mechanism": "green_context",
                    "decode_sms": k,
                    "finetune_sms": info.finetune_sms,
                    "gemm_ms_p50": g,
                    "gemm_tflops": w.big_flops / g / 1e9,
                }
            )
    g = statistics.median(time_on(full_ft, w.big_gemm, 10)[2:])
    rows.append(
        {
            "experiment": "gemm_alone",
            "mechanism": "streams",
            "decode_sms": 0,
            "finetune_sms": sharing.table.total_sms,
            "gemm_ms_p50": g,
            "gemm_tflops": w.big_flops / g / 1e9,
        }
    )
    return rows


def beside_rows(
    sharing: SmPartitioner,
    fallback: StreamSharing,
    w: Workloads,
    copy_tbs: float,
    reps: int,
    g_full_ms: float,
) -> list[dict[str, Any]]:
    """Both workloads at once: green split 48/84 and 72/60, prioritised streams, naive streams."""
    total = sharing.table.total_sms
    naive = (torch.cuda.Stream(w.x.device), torch.cuda.Stream(w.x.device))
    pairs: list[tuple[str, int, torch.cuda.Stream, torch.cuda.Stream]] = [
        ("green_context", k, *sharing.partition(k)) for k in (48, 72)
    ]
    pairs += [("streams", total, *fallback.partition(total)), ("naive", total, *naive)]
    rows = []
    for mech, k, ds, fs in pairs:
        fsms = total - k if mech == "green_context" else 0
        # The background queue must outlast the timed calls (13x slowdowns were seen unsplit).
        bg_reps = 80 if mech == "green_context" else 300
        rows.append(
            _decode_row(
                w.decode_bytes,
                copy_tbs,
                "decode_beside_gemm",
                mech,
                k,
                fsms,
                "gemm8192",
                time_beside(ds, w.decode_pass, reps, fs, w.big_gemm, bg_reps),
            )
        )
        g = statistics.median(time_beside(fs, w.big_gemm, 10, ds, w.decode_pass, 150)[2:])
        rows.append(
            {
                "experiment": "gemm_beside_decode",
                "mechanism": mech,
                "decode_sms": k,
                "finetune_sms": fsms,
                "background": "decode_pass",
                "gemm_ms_p50": g,
                "gemm_tflops": w.big_flops / g / 1e9,
                "gemm_frac_of_full": g_full_ms / g,
            }
        )
    return rows


def switching(sharing: SmPartitioner, w: Workloads) -> dict[str, float]:
    """Per-iteration wall time staying on one split vs switching split every iteration."""

    def loop(splits: list[int]) -> float:
        prev = sharing.partition(splits[0])[0]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for k in splits:
            ds = sharing.partition(k)[0]
            if ds is not prev:
                ds.wait_stream(prev)  # iteration t+1 reads what iteration t wrote
            with torch.cuda.stream(ds):
                w.decode_pass()
            prev = ds
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / len(splits)

    n = 60
    fixed48, fixed56 = loop([48] * n), loop([56] * n)
    alternating = loop([48, 56] * (n // 2))
    start = time.perf_counter()
    for i in range(10000):
        sharing.partition(48 if i % 2 else 56)
    return {
        "fixed48_ms": fixed48,
        "fixed56_ms": fixed56,
        "alternating_ms": alternating,
        "switch_overhead_ms": alternating - (fixed48 + fixed56) / 2,
        "partition_lookup_us": (time.perf_counter() - start) * 1e6 / 10000,
    }


def graphs(
    sharing: SmPartitioner, fallback: StreamSharing, w: Workloads, reps: int
) -> dict[str, float]:
    """Replay time of a decode-pass graph by (stream it was captured on, stream replaying it)."""
    streams = {
        "p48": sharing.partition(48)[0],
        "full": fallback.partition(sharing.table.total_sms)[0],
    }
    captured = {}
    for name, stream in streams.items():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            w.decode_pass()
        captured[name] = g
    out = {}
    for cap in streams:
        for rep, stream in streams.items():
            times = time_on(stream, captured[cap].replay, reps)
            out[f"captured_{cap}_replayed_{rep}_ms"] = statistics.median(times[3:])
    return out


def torch_green_context(w: Workloads, reps: int) -> dict[str, Any]:
    """What this torch's own GreenContext offers: creation cost, push/pop cost, 48-SM speed."""
    from torch.cuda import GreenContext

    start = time.perf_counter()
    ctx: Any = GreenContext.create(num_sms=48, device_id=0)
    out: dict[str, Any] = {
        "create_ms": (time.perf_counter() - start) * 1e3,
        "methods": sorted(m for m in dir(ctx) if not m.startswith("_")),
    }
    enter = getattr(ctx, "set_context", None) or ctx.make_current
    leave = getattr(ctx, "pop_context", None) or ctx.pop_current
    start = time.perf_counter()
    for _ in range(100):
        enter()
        leave()
    torch.cuda.synchronize()
    out["push_pop_us"] = (time.perf_counter() - start) * 1e4
    enter()
    try:
        times = time_on(torch.cuda.current_stream(), w.decode_pass, reps)
    finally:
        leave()
    out["decode_pass_ms_p50_in_48"] = statistics.median(times[3:])
    return out
