"""Unified memory benchmarks on an H200.

    python3 bench/memory.py mechanism [--out DIR]   # facts the pool is built on (about 40 s)
    python3 bench/memory.py trace [--duration 25 --job-pool-extra-gib 12 ...]   # 4 phases
    python3 bench/memory.py trace --model tiny --device cpu ...   # smoke run (see --help)

`trace` (Llama-3-8B shape, seeded random bf16 weights): a bursty decode trace (`memory-bursty`:
Poisson bursts of 45 x `--rate-scale` requests/s for 4 s, 6 s quiet; prompts log-normal median
`--prompt-median` (1536) tokens in [median/6, 2 x median], outputs median `--output-median`
(256) in [median/8, 3 x median]; seeded, identical for every phase) runs through the host loop
in four phases (`--phases`): `decode_only` (no job, whole device), `decode_only_split` (no job,
decode on the `--decode-sms` green-context split), `unified` and `static_split` (one LoRA job:
rank 16, q/k/v/o, synthetic `--ft-seq-len`-token examples, CUDA-graphed quanta on the split's
other SMs unless `--ft-eager`, sized to the budget they read: at most `--max-examples`
examples, a safety factor that shrinks after an out-of-memory error). `unified`: the pool moves
pages both ways, quanta planned below decode's expected reclaims (`--plan-headroom-*`).
`static_split`: decode keeps the KV peak `unified` measured (plus the low watermark) and
finetuning gets the rest for good. `unified` also plans quanta beside decode's peak over the last
`--plan-peak-window` quantum boundaries (starting from `decode_only`'s KV peak); the optional
phase `unified_no_peak` plans without that term (more memory for graphed quanta, which the next
burst may have to flush). `--job-pool-extra-gib` sizes the two job phases' pool from
`decode_only`'s KV peak. Per phase: OOMs (finetune quanta lost to out-of-memory), dropped
requests (rejected, or lost: neither finished nor still queued/running), requests still
unfinished when `--drain` s after the last arrival ran out (a window limit, reported apart),
reclaims (p50/p99, cache flushes, taken while a quantum ran, waits), decode iteration time
(p50 with a 95% interval, p99, without prefill, the slowest iterations and what happened in
them; the whole loop iteration, pool work included), TPOT, finetune memory (budget lent,
planned for, allocator reserved: time-weighted means, max, a time series), tokens/s and the
job's graph counts; `comparisons` holds the ratios between phases. A phase that fails becomes a
row with its error; the file is written after each phase: `memory-<gpu>-<yyyymmdd>.json`. Code:
`bench/memory_trace.py` (setup, phases, result file), `bench/memory_phase.py` (one phase),
`bench/memory_sizing.py` (the finetune side's quantum sizing).

`mechanism` measures the CUDA virtual-memory mechanism under `gpu_runtime/memory`: map/unmap cost
per 2 MiB page (per driver call, per-page vs batched access, chunks of 2 to 128 MiB), the time
to move 1 GiB between KV and torch in both directions, that unmapped memory is usable by torch at
once (and that the finetune cap holds), whether map/unmap/empty_cache wait for in-flight kernels,
that the KV view keeps its data across remaps, and the caching allocator's cache-flush costs with
and without expandable segments. Writes `memory-mechanism-<gpu>-<yyyymmdd>.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20
GIB = 1 << 30
PAGE = 2 * MIB
CHUNK_SWEEP_MIB = (2, 8, 32, 128)


def commit_hash() -> str:
    for name in ("HARLI_COMMIT", "GIT_COMMIT"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_slug(name: str) -> str:
    lowered = name.lower()
    for known in ("h200", "h100", "a100", "l40s"):
        if known in lowered:
            return known
    return "".join(ch if ch.isalnum() else "-" for ch in lowered).strip("-") or "gpu"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Recorder:
    """Rows of one result file; a failing section records its error and the run goes on."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def value(self, section: str, measure: str, value: float, unit: str, **extra: Any) -> None:
        self.rows.append(
            {"section": section, "measure": measure, "value": value, "unit": unit, **extra}
        )

    def check(self, section: str, name: str, passed: bool, detail: str = "") -> None:
        self.rows.append(
            {"section": section, "check": name, "passed": bool(passed), "detail": detail}
        )

    def run(self, section: str, body: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            body()
        except Exception as exc:  # a section's failure is a result, not the end of the run
            self.check(section, "section completed", False, f"{type(exc).__name__}: {exc}")
        else:
            self.check(section, "section completed", True)
        print(f"[{section}] {time.perf_counter() - start:.1f} s", flush=True)


# ---- raw driver costs --------------------------------------------------------------------
def _driver_costs(rec: Recorder, pages: int = 512, rounds: int = 3) -> None:
    import torch
    from cuda.bindings import driver as cu

    from gpu_runtime.memory.cuda_backend import CudaVmmBackend

    # The backend's constructor makes the context current and builds prop/access.
    probe = CudaVmmBackend(pool_bytes=PAGE, chunk_bytes=PAGE)
    prop, access, call = probe._prop, probe._access, probe._call
    t0 = time.perf_counter()
    (base,) = call(cu.cuMemAddressReserve(100 * GIB, PAGE, 0, 0))
    rec.value("driver", "reserve_100GiB", (time.perf_counter() - t0) * 1e6, "us")
    base = int(base)

    def addr(offset: int) -> Any:
        return cu.CUdeviceptr(base + offset)

    per_call: dict[str, list[float]] = {
        k: [] for k in ("create", "map", "set_access", "unmap", "release")
    }
    totals: dict[str, list[float]] = {
        k: []
        for k in (
            "map_per_page_access",
            "map_batched_access",
            "unmap",
        )
    }
    for _ in range(rounds):
        handles = []
        start = time.perf_counter()
        for i in range(pages):
            a = time.perf_counter()
            (h,) = call(cu.cuMemCreate(PAGE, prop, 0))
            b = time.perf_counter()
            call(cu.cuMemMap(addr(i * PAGE), PAGE, 0, h, 0))
            c = time.perf_counter()
            call(cu.cuMemSetAccess(addr(i * PAGE), PAGE, access, 1))
            d = time.perf_counter()
            per_call["create"].append(b - a)
            per_call["map"].append(c - b)
            per_call["set_access"].append(d - c)
            handles.append(h)
        totals["map_per_page_access"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for i, h in enumerate(handles):
            a = time.perf_counter()
            call(cu.cuMemUnmap(addr(i * PAGE), PAGE))
            b = time.perf_counter()
            call(cu.cuMemRelease(h))
            per_call["unmap"].append(b - a)
            per_call["release"].append(time.perf_counter() - b)
        totals["unmap"].append(time.perf_counter() - start)
        # Batched access: one cuMemSetAccess over the whole run of mappings.
        handles = []
        start = time.perf_counter()
        for i in range(pages):
            (h,) = call(cu.cuMemCreate(PAGE, prop, 0))
            call(cu.cuMemMap(addr(i * PAGE), PAGE, 0, h, 0))
            handles.append(h)
        call(cu.cuMemSetAccess(addr(0), pages * PAGE, access, 1))
        totals["map_batched_access"].append(time.perf_counter() - start)
        probe_tensor = torch.as_tensor(_range_view(base, pages * PAGE), device="cuda")
        probe_tensor.fill_(7)
        torch.cuda.synchronize()
        ok = bool((probe_tensor[:: PAGE // 2] == 7).all().item())
        del probe_tensor
        for i, h in enumerate(handles):
            call(cu.cuMemUnmap(addr(i * PAGE), PAGE))
            call(cu.cuMemRelease(h))
        # Bigger chunks: fewer driver calls for the same bytes.
        for chunk_mib in CHUNK_SWEEP_MIB:
            chunk = chunk_mib * MIB
            n_chunks = pages * PAGE // chunk
            handles = []
            start = time.perf_counter()
            for i in range(n_chunks):
                (h,) = call(cu.cuMemCreate(chunk, prop, 0))
                call(cu.cuMemMap(addr(i * chunk), chunk, 0, h, 0))
                handles.append(h)
            call(cu.cuMemSetAccess(addr(0), pages * PAGE, access, 1))
            totals.setdefault(f"map_{chunk_mib}MiB_chunks", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            for i, h in enumerate(handles):
                call(cu.cuMemUnmap(addr(i * chunk), chunk))
                call(cu.cuMemRelease(h))
            totals.setdefault(f"unmap_{chunk_mib}MiB_chunks", []).append(
                time.perf_counter() - start
            )
    rec.check("driver", "batched cuMemSetAccess over many mappings works", ok)
    for name, samples in per_call.items():
        rec.value("driver", f"{name}_per_2MiB_p50", _median(samples) * 1e6, "us")
        rec.value("driver", f"{name}_per_2MiB_p99", _pct(samples, 99) * 1e6, "us")
    gib = pages * PAGE / GIB
    for name, samples in totals.items():
        rec.value("driver", f"{name}_per_GiB", _median(samples) / gib * 1e3, "ms")
    call(cu.cuMemAddressFree(cu.CUdeviceptr(base), 100 * GIB))
    probe.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def _range_view(address: int, nbytes: int) -> Any:
    from gpu_runtime.memory.cuda_backend import _DeviceRange

    return _DeviceRange(address, nbytes)


# ---- backend: view correctness, in-flight behaviour, moves --------------------------------
def _view_correctness(rec: Recorder) -> None:
    import torch

    from gpu_runtime.memory.cuda_backend import CudaVmmBackend

    for per_page in (False, True):
        backend = CudaVmmBackend(pool_bytes=4 * GIB, access_per_page=per_page)
        backend.set_finetune_cap(2 * GIB)
        try:
            assert backend.map_range(0, 64) == 64
            view = backend.kv_storage()
            pages = view[: 64 * PAGE].view(64, PAGE).view(torch.bfloat16)
            gen = torch.Generator(device="cuda").manual_seed(1)
            data = torch.randn(pages.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
            pages.copy_(data)
            backend.unmap_range(32, 32)
            assert backend.map_range(32, 32) == 32
            fresh = torch.randn((32, PAGE // 2), generator=gen, device="cuda", dtype=torch.bfloat16)
            pages[32:].copy_(fresh)
            kept = torch.equal(pages[:32], data[:32])
            rewritten = torch.equal(pages[32:], fresh)
            # A compute kernel reading through the view, against the same math on a copy.
            mat = pages[:16].reshape(-1, 1024)[:4096]
            ref = mat.clone().float()
            out = mat.float() @ ref.T[:, :64]
            close = torch.allclose(out, ref @ ref.T[:, :64], rtol=1e-4, atol=1e-3)
            torch.cuda.synchronize()
            tag = "per-page access" if per_page else "batched access"
            rec.check("view", f"mapped pages keep data across remap ({tag})", kept)
            rec.check("view", f"remapped pages read what was written ({tag})", rewritten)
            rec.check("view", f"matmul through the view matches a copy ({tag})", close)
        finally:
            backend.close()


def _in_flight(rec: Recorder) -> None:
    import torch

    from gpu_runtime.memory.cuda_backend import CudaVmmBackend

    backend = CudaVmmBackend(pool_bytes=4 * GIB)
    try:
        backend.set_finetune_cap(4 * GIB)
        backend.map_range(0, 64)
        view = backend.kv_storage()
        cycles = int(2e8)  # about 0.1 s at the H200's 1.98 GHz
        for name, action in (
            ("map_16_pages", lambda: backend.map_range(64, 16)),
            ("unmap_16_pages", lambda: backend.unmap_range(64, 16)),
            ("empty_cache_1GiB", lambda: torch.cuda.empty_cache()),
        ):
            if name.startswith("empty_cache"):
                scratch = torch.empty(GIB, dtype=torch.uint8, device="cuda")
                del scratch
            view[:PAGE].fill_(1)  # a kernel touching mapped KV while the call runs
            torch.cuda.synchronize()
            done = torch.cuda.Event()
            torch.cuda._sleep(cycles)
            done.record()
            start = time.perf_counter()
            action()
            elapsed = time.perf_counter() - start
            still_running = not done.query()
            torch.cuda.synchronize()
            rec.value("in_flight", f"{name}_host_time", elapsed * 1e3, "ms")
            rec.check(
                "in_flight",
                f"{name} returns while a 0.1 s kernel runs",
                still_running,
                f"host time {elapsed * 1e3:.2f} ms",
            )
    finally:
        backend.close()


def _usable_at_once(rec: Recorder) -> None:
    import torch

    from gpu_runtime.memory.cuda_backend import CudaVmmBackend

    torch.cuda.empty_cache()
    backend = CudaVmmBackend(leave_free_bytes=2 * GIB)
    try:
        n = backend.num_pages
        start = time.perf_counter()
        mapped = backend.map_range(0, n)
        rec.value("usable", "map_whole_pool", (time.perf_counter() - start) * 1e3, "ms", pages=n)
        rec.check("usable", "whole pool mapped", mapped == n, f"{mapped} of {n} pages")
        backend.set_finetune_cap(40 * GIB)
        try:
            torch.empty(6 * GIB, dtype=torch.uint8, device="cuda")
            rec.check("usable", "6 GiB torch alloc fails while the pool is mapped", False)
        except torch.OutOfMemoryError:
            rec.check("usable", "6 GiB torch alloc fails while the pool is mapped", True)
        release = 10240  # 20 GiB
        start = time.perf_counter()
        backend.unmap_range(n - release, release)
        rec.value("usable", "unmap_20GiB", (time.perf_counter() - start) * 1e3, "ms")
        start = time.perf_counter()
        big = torch.empty(18 * GIB, dtype=torch.uint8, device="cuda")
        big.fill_(3)
        torch.cuda.synchronize()
        rec.value("usable", "torch_alloc_fill_18GiB", (time.perf_counter() - start) * 1e3, "ms")
        rec.check("usable", "18 GiB torch alloc right after unmapping 20 GiB", True)
        del big
        # Cap: budget 1 GiB -> a 4 GiB finetune tensor must fail; raised -> it fits.
        torch.cuda.empty_cache()
        backend.set_finetune_cap(1 * GIB)
        try:
            torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
            rec.check("usable", "finetune cap stops a 4 GiB alloc under 1 GiB budget", False)
        except torch.OutOfMemoryError:
            rec.check("usable", "finetune cap stops a 4 GiB alloc under 1 GiB budget", True)
        backend.set_finetune_cap(8 * GIB)
        ok = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
        rec.check("usable", "4 GiB alloc fits after the cap rises to 8 GiB", ok.numel() == 4 * GIB)
        del ok
        start = time.perf_counter()
        for i in range(100):
            backend.set_finetune_cap((i % 8 + 1) * GIB)
        rec.value("usable", "set_finetune_cap", (time.perf_counter() - start) * 1e4, "us")
        torch.cuda.empty_cache()
        start = time.perf_counter()
        back = backend.map_range(n - release, release)
        rec.value("usable", "remap_20GiB", (time.perf_counter() - start) * 1e3, "ms")
        rec.check("usable", "20 GiB maps again after torch frees it", back == release)
        start = time.perf_counter()
        backend.unmap_range(0, len(backend.mapped_slots()))
        rec.value("usable", "unmap_whole_pool", (time.perf_counter() - start) * 1e3, "ms")
    finally:
        backend.close()


def _move_one_gib(rec: Recorder, rounds: int = 5) -> None:
    """KV -> torch: unmap 1 GiB, allocate and fill it. torch -> KV: free, flush the cache,
    map 1 GiB. Whole pool mapped first, so the memory really has to move."""
    import torch

    from gpu_runtime.memory.cuda_backend import CudaVmmBackend

    for chunk_mib in (2, 32):
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        backend = CudaVmmBackend(pool_bytes=free - 2 * GIB, chunk_bytes=chunk_mib * MIB)
        samples: dict[str, list[float]] = {"unmap": [], "torch_alloc": [], "flush": [], "map": []}
        try:
            n = backend.num_pages
            backend.map_range(0, n)
            backend.set_finetune_cap(2 * GIB)
            k = GIB // PAGE
            for _ in range(rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                backend.unmap_range(n - k, k)
                t1 = time.perf_counter()
                t = torch.empty(GIB, dtype=torch.uint8, device="cuda")
                t.fill_(1)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                del t
                torch.cuda.empty_cache()
                t3 = time.perf_counter()
                got = backend.map_range(n - k, k)
                t4 = time.perf_counter()
                if got != k:
                    raise RuntimeError(f"re-mapped {got} of {k} pages")
                for key, value in zip(samples, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    samples[key].append(value)
        finally:
            backend.close()
        for key, values in samples.items():
            rec.value("move", f"1GiB_{key}_p50", _median(values) * 1e3, "ms", chunk_mib=chunk_mib)
        to_kv = [a + b for a, b in zip(samples["flush"], samples["map"], strict=True)]
        rec.value("move", "1GiB_torch_to_kv_max", max(to_kv) * 1e3, "ms", chunk_mib=chunk_mib)


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
            [sys.executable, str(Path(__file__).resolve()), "allocator"],
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
    rec.run("driver", lambda: _driver_costs(rec))
    rec.run("view", lambda: _view_correctness(rec))
    rec.run("in_flight", lambda: _in_flight(rec))
    rec.run("usable", lambda: _usable_at_once(rec))
    rec.run("move", lambda: _move_one_gib(rec))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mech = sub.add_parser("mechanism", help="measure the CUDA VMM mechanism")
    mech.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    sub.add_parser("allocator", help="(internal) caching-allocator costs, JSON on stdout")
    tr = sub.add_parser("trace", help="unified pool vs static split on a bursty decode trace")
    tr.add_argument("--model", default="llama3-8b", help="preset: llama3-8b, qwen2.5-7b, tiny")
    tr.add_argument("--device", default="cuda")
    tr.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals a phase")
    tr.add_argument("--drain", type=float, default=30.0, help="most seconds to finish after")
    tr.add_argument("--rate-scale", type=float, default=1.0)
    tr.add_argument("--prompt-median", type=int, default=1536, help="prompt tokens (median)")
    tr.add_argument("--output-median", type=int, default=256, help="output tokens (median)")
    tr.add_argument("--pool-gib", type=float, default=80.0, help="pool size (KV + finetune)")
    tr.add_argument("--max-model-len", type=int, default=4096)
    tr.add_argument("--max-num-seqs", type=int, default=256)
    tr.add_argument("--max-batched-tokens", type=int, default=2048)
    tr.add_argument("--phases", default="decode_only,decode_only_split,unified,static_split")
    tr.add_argument(
        "--job-pool-extra-gib",
        type=float,
        default=None,
        help="pool of the phases with a job: decode_only's KV peak + the low watermark + this "
        "(default: --pool-gib for every phase)",
    )
    tr.add_argument(
        "--decode-only-kv-peak-blocks",
        type=int,
        default=None,
        help="decode's KV peak alone on this trace, from an earlier run (its decode_only "
        "kv_peak_blocks): used for --job-pool-extra-gib and --plan-peak-prior when the "
        "decode_only phase does not run",
    )
    tr.add_argument("--ft-seq-len", type=int, default=512)
    tr.add_argument("--max-examples", type=int, default=4, help="most examples per quantum")
    tr.add_argument(
        "--sharing",
        choices=("green", "streams"),
        default="green",
        help="green: decode on a `--decode-sms` SM partition, quanta on the rest (falls back "
        "to streams when green contexts are unavailable); streams: decode on a high-priority "
        "full-device stream, quanta on a low-priority one",
    )
    tr.add_argument("--decode-sms", type=int, default=96, help="decode's SMs beside a job")
    tr.add_argument(
        "--plan-headroom-intervals",
        type=int,
        default=4,
        help="quanta are sized to the budget less this many intervals of decode's recent "
        "growth, so most reclaims need no cache flush (MemoryPolicyConfig)",
    )
    tr.add_argument(
        "--plan-headroom-min-pages",
        type=int,
        default=None,
        help="floor of that headroom (default: the low watermark plus the waiting prompts' "
        "cap, what a burst's first refill takes)",
    )
    tr.add_argument(
        "--plan-peak-window",
        type=int,
        default=256,
        help="quanta are also planned beside decode's peak over this many quantum boundaries "
        "(MemoryPolicyConfig.plan_peak_window; 0: off). Phase `unified_no_peak` runs without",
    )
    tr.add_argument(
        "--plan-peak-prior",
        choices=("decode_only", "none"),
        default="decode_only",
        help="decode_only: the unified phase's peak window starts with decode_only's KV peak "
        "(the same trace; a host's history), aging out like any observation",
    )
    tr.add_argument("--reserve-low-pages", type=int, default=1024)
    tr.add_argument("--reserve-high-pages", type=int, default=3072)
    tr.add_argument(
        "--torch-headroom-gib",
        type=float,
        default=8.0,
        help="torch memory decode may add after warm-up, outside the finetune budget (the "
        "engine's eager mixed prefill+decode steps allocate GiBs at batch ~200)",
    )
    tr.add_argument(
        "--ft-eager",
        action="store_true",
        help="eager finetune quanta (default: CUDA-graphed, captured per shape on the "
        "finetune stream during warm-up; the graphs' private pool is sized into each "
        "quantum's budget and dropped by a reclaim that must flush)",
    )
    tr.add_argument("--step-pages", type=int, default=512)
    tr.add_argument("--hysteresis", type=int, default=50)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = parser.parse_args(argv)
    if args.command == "allocator":
        print(json.dumps(allocator_costs()))
        return 0
    if args.command == "trace":
        from bench.memory_trace import trace_benchmark

        path = trace_benchmark(args)
        print(f"wrote {path}")
        return 0
    path = mechanism(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
