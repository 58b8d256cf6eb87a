"""What each GPU sharing mechanism costs on this GPU (green-context SM partitions vs streams).

Run on the GPU host: ``PYTHONPATH=. python3 bench/sharing.py --commit <sha> [--out DIR]``.
Writes ``sharing-<gpu>-<yyyymmdd>.json`` (BENCHMARKS.md layout) and prints a table last.

Workloads:
  * decode-like pass: 16 GEMMs ``x[64, 4096] @ W_i[4096, 14336]`` (bf16, 1.88 GB of distinct
    weights, far over the 60 MB L2): the memory-bound shape of a decode iteration.
  * finetune-like load: back-to-back ``8192^3`` bf16 GEMMs (compute-bound).
Figures: partition creation time; decode pass time/bandwidth per decode SM count alone; both
workloads side by side with a 48/84 or 72/60 split, with plain streams (priorities) and with none;
the cost of switching split every iteration; which SMs a CUDA graph replays on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.provenance import commit_hash
from gpu_runtime.sharing import SmPartitioner, StreamSharing

HIDDEN, INTER, N_WEIGHTS, DECODE_BATCH = 4096, 14336, 16, 64
BIG = 8192


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Workloads:
    """Tensors for the decode-like pass and the big GEMM, allocated once (random, seeded)."""

    def __init__(self, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(
            DECODE_BATCH, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen
        )
        self.weights = [
            torch.randn(HIDDEN, INTER, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(N_WEIGHTS)
        ]
        self.out = torch.empty(N_WEIGHTS, DECODE_BATCH, INTER, device=device, dtype=torch.bfloat16)
        self.a = torch.randn(BIG, BIG, device=device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(BIG, BIG, device=device, dtype=torch.bfloat16, generator=gen)
        self.c = torch.empty(BIG, BIG, device=device, dtype=torch.bfloat16)
        self.decode_bytes = (
            N_WEIGHTS * HIDDEN * INTER * 2 + N_WEIGHTS * DECODE_BATCH * (HIDDEN + INTER) * 2
        )
        self.big_flops = 2 * BIG**3

    def decode_pass(self) -> None:
        for i, w in enumerate(self.weights):
            torch.mm(self.x, w, out=self.out[i])

    def big_gemm(self) -> None:
        torch.mm(self.a, self.b, out=self.c)


def time_on(stream: torch.cuda.Stream, fn: Callable[[], object], reps: int) -> list[float]:
    """Per-call milliseconds of ``fn`` enqueued ``reps`` times on ``stream`` (CUDA events)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    with torch.cuda.stream(stream):
        events[0].record(stream)
        for i in range(reps):
            fn()
            events[i + 1].record(stream)
    stream.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(reps)]


def time_beside(
    fg_stream: torch.cuda.Stream,
    fg: Callable[[], None],
    fg_reps: int,
    bg_stream: torch.cuda.Stream,
    bg: Callable[[], None],
    bg_reps: int,
) -> list[float]:
    """Time ``fg`` while a queue of ``bg`` calls runs on ``bg_stream`` (queued first)."""
    with torch.cuda.stream(bg_stream):
        for _ in range(bg_reps):
            bg()
    times = time_on(fg_stream, fg, fg_reps)
    torch.cuda.synchronize()
    return times


def _decode_row(
    w: Workloads,
    copy_tbs: float,
    experiment: str,
    mech: str,
    dsms: int,
    fsms: int,
    bg: str,
    times: list[float],
) -> dict[str, Any]:
    p50 = statistics.median(times[3:])
    return {
        "experiment": experiment,
        "mechanism": mech,
        "decode_sms": dsms,
        "finetune_sms": fsms,
        "background": bg,
        "decode_pass_ms_p50": p50,
        "decode_pass_ms_p99": _pct(times[3:], 0.99),
        "bandwidth_tbs": w.decode_bytes / p50 / 1e9,
        "bandwidth_frac": w.decode_bytes / p50 / 1e9 / copy_tbs,
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
                w,
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
                w,
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


def _guard(notes: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """Run one section; record its failure in notes instead of losing the whole run."""
    try:
        value = fn()
    except Exception as exc:  # a broken section must not cost the other figures
        notes[key] = {"error": f"{type(exc).__name__}: {exc}"}
        return None
    notes[key] = value
    return value


def probe(groups: tuple[int, ...] | None) -> None:
    """Create the partitions, run a decode-shaped bf16 GEMM on every stream; exit 1 on error."""
    device = torch.device("cuda", 0)
    stage = "create"
    try:
        sharing = SmPartitioner(device, groups)
        x = torch.randn(DECODE_BATCH, HIDDEN, device=device, dtype=torch.bfloat16)
        w = torch.randn(HIDDEN, INTER, device=device, dtype=torch.bfloat16)
        stage = "default stream"
        reference = (x @ w).float()
        torch.cuda.synchronize()
        for k in sharing.table.choices:
            for side, stream in zip(("decode", "finetune"), sharing.partition(k), strict=True):
                stage = f"{side} stream of split {k}"
                with torch.cuda.stream(stream):
                    out = (x @ w).float()
                stream.synchronize()
                torch.testing.assert_close(out, reference, rtol=1e-2, atol=1e-1)
        sharing.close()
    except Exception as exc:
        print(f"PROBE groups={groups} FAIL at {stage}: {type(exc).__name__}: {str(exc)[:300]}")
        raise SystemExit(1) from exc
    print(f"PROBE groups={groups} OK granted={sharing.granted}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--groups", default="", help="decode SM groups k (k*8 SMs), e.g. 2,4,6")
    parser.add_argument("--probe", action="store_true", help="only check creation + a bf16 GEMM")
    args = parser.parse_args()
    groups = tuple(int(k) for k in args.groups.split(",")) if args.groups else None
    if args.probe:
        probe(groups)
        return
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    notes: dict[str, Any] = {}
    reps = args.reps

    t0 = time.perf_counter()
    sharing = SmPartitioner(device, groups)
    notes["partition_creation_s_total"] = time.perf_counter() - t0
    notes["partition_creation_s_contexts"] = sharing.creation_s
    notes["partitions_created"] = len(sharing.table.decode_sms_options)
    notes["granted_sms"] = {str(k): v for k, v in sharing.granted.items()}
    fallback = StreamSharing(device)
    w = Workloads(device)
    full_decode, full_ft = fallback.partition(props.multi_processor_count)

    # Bandwidth ceiling measured now: a 2 GiB device-to-device copy (read + write bytes).
    src = torch.empty(2**30, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_ms = statistics.median(time_on(full_decode, lambda: dst.copy_(src), 10))
    copy_tbs = 2 * src.numel() * 2 / copy_ms / 1e9
    notes["copy_bandwidth_tbs"] = copy_tbs

    # Correctness: the same pass on a partition stream matches the default stream.
    w.decode_pass()
    torch.cuda.synchronize()
    reference = w.out.float().clone()
    ds48 = sharing.partition(48)[0]
    with torch.cuda.stream(ds48):
        w.out.fill_(float("nan"))
        w.decode_pass()
    ds48.synchronize()
    rel = ((w.out.float() - reference).norm() / reference.norm()).item()
    notes["partition_output_rel_err"] = rel
    if not rel < 1e-2:
        raise SystemExit(f"decode pass on the 48-SM partition differs from reference: {rel}")

    for _ in range(3):  # warm every stream's cuBLAS workspace
        for k in sharing.table.choices:
            for s in sharing.partition(k):
                with torch.cuda.stream(s):
                    w.decode_pass()
                    w.big_gemm()
    torch.cuda.synchronize()

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

    result = {
        "name": "sharing",
        "commit": args.commit or commit_hash(),
        "gpu": props.name,
        "torch": torch.__version__,
        "created": dt.datetime.now(dt.UTC).isoformat(),
        "config": {
            "decode_pass": f"{N_WEIGHTS}x [{DECODE_BATCH},{HIDDEN}]@[{HIDDEN},{INTER}]",
            "decode_bytes": w.decode_bytes,
            "big_gemm": BIG,
            "reps": reps,
            "sms": props.multi_processor_count,
        },
        "notes": notes,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = props.name.split()[-1].lower()
    path = out / f"sharing-{gpu}-{dt.datetime.now(dt.UTC):%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=1))
    # Last, since it pushes contexts: torch's own green context API on this version.
    _guard(notes, "torch_green_context", lambda: torch_green_context(w, reps))
    path.write_text(json.dumps(result, indent=1))
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


if __name__ == "__main__":
    main()
