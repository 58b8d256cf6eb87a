"""Unified memory benchmarks on an H200.

    python3 bench/memory.py mechanism [--out DIR]   # facts the pool is built on (about 40 s)
    python3 bench/memory.py trace [--duration 60 --pool-gib 80]   # unified vs static split
    python3 bench/memory.py trace --model tiny --device cpu ...   # smoke run (see --help)

`trace` (Llama-3-8B shape, seeded random bf16 weights): a bursty decode trace (`memory-bursty`:
Poisson bursts of 45 requests/s for 4 s, 6 s quiet; prompts log-normal median 1536 tokens in
[256, 3072], outputs median 256 in [32, 768]; seeded, identical for both phases) runs through the
host loop with one LoRA job (rank 16, q/k/v/o, synthetic `--ft-seq-len`-token examples) whose
quanta are sized to the budget they read (at most `--max-examples` examples; a safety factor
that shrinks after an out-of-memory error). On CUDA decode runs on a high-priority stream and the
quanta on a low-priority one (`StreamSharing`), decode graphs captured on decode's stream.
Phase `unified`: the pool moves pages both ways. Phase `static_split`: decode keeps the KV peak
`unified` measured (plus the low watermark) and finetuning gets the rest for good. Per phase:
OOMs (finetune quanta lost to out-of-memory), dropped requests (rejected, or lost: neither
finished nor still queued/running), requests still unfinished when `--drain` s after the last
arrival ran out (a window limit, reported apart), reclaim latency p50/p99 (and its cache-flush
part), decode iteration time p50/p99 (the whole loop iteration, pool work included), TPOT,
finetune memory borrowed (time-weighted mean, max, and a time series) and finetune tokens/s.
A phase that fails becomes a row with its error; the file is written after each phase:
`memory-<gpu>-<yyyymmdd>.json`.

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
import itertools
import json
import logging
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


def _commit() -> str:
    if os.environ.get("HARLI_COMMIT"):
        return os.environ["HARLI_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _gpu_slug(name: str) -> str:
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
        "commit": _commit(),
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
    path = out_dir / f"memory-mechanism-{_gpu_slug(props.name)}-{today:%Y%m%d}.json"
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


# ---- trace: unified pool vs static split under a bursty decode load with a LoRA job --------
def _trace_spec(tiny: bool, duration_s: float, rate_scale: float) -> Any:
    """Bursty decode load: Poisson bursts of `on_s` s, quiet `off_s` s; long prompts.

    Llama-3-8B on an H200: about 45 arrivals/s in a burst with ~5 s requests swings the decode
    batch between a handful and ~200 sequences of ~1.5k-token contexts (~50 GB of KV at peak)."""
    from bench.traces import LengthDistribution, TraceSpec

    if tiny:
        prompt = LengthDistribution(median=48, sigma=0.4, minimum=8, maximum=120)
        output = LengthDistribution(median=16, sigma=0.4, minimum=4, maximum=40)
        return TraceSpec(
            "memory-bursty",
            "onoff",
            12.0 * rate_scale,
            duration_s,
            prompt,
            output,
            on_s=1.0,
            off_s=1.5,
        )
    prompt = LengthDistribution(median=1536, sigma=0.4, minimum=256, maximum=3072)
    output = LengthDistribution(median=256, sigma=0.5, minimum=32, maximum=768)
    return TraceSpec(
        "memory-bursty", "onoff", 45.0 * rate_scale, duration_s, prompt, output, on_s=4.0, off_s=6.0
    )


class _QuantumSizing:
    """What the finetune side knows to size a quantum: its footprint and a safety factor that
    shrinks after an out-of-memory error (the finetune side's adaptation)."""

    def __init__(self, resident_bytes: int, bytes_per_token: float, max_examples: int) -> None:
        self.resident_bytes = resident_bytes
        self.bytes_per_token = bytes_per_token
        self.max_examples = max_examples
        self.safety = 0.9

    def tokens(self, budget_bytes: int, max_seq_len: int) -> int:
        room = (budget_bytes - self.resident_bytes) * self.safety
        return min(int(room / self.bytes_per_token), self.max_examples * max_seq_len)


def _budgeted_policy(sizing: _QuantumSizing, decode_sms: int | None) -> Any:
    """A quantum beside decode whenever none runs, sized to the budget it reads (fewer
    examples per micro-batch when the budget is small); `decode_sms` is the stream sharing's
    only split (the whole device) on CUDA, None on CPU."""
    from gpu_runtime.colocation import CoLocationPolicy, FinetuneLaunch, IterationPlan

    class BudgetedQuanta(CoLocationPolicy):
        name = "budgeted"

        def plan(self, ctx: Any) -> Any:
            if not ctx.jobs or ctx.in_flight is not None:
                return IterationPlan(decode_sms=decode_sms)
            job = ctx.jobs[0]
            budget = ctx.finetune_budget_bytes or 0
            tokens = sizing.tokens(budget, job.max_seq_len)
            if tokens < job.max_seq_len:
                return IterationPlan(
                    decode_sms=decode_sms, paused=True, note=f"budget {budget} B too small"
                )
            launch = FinetuneLaunch(job.job_id, tokens)
            return IterationPlan(decode_sms=decode_sms, launches=(launch,))

    return BudgetedQuanta()


def _finetune_footprint(trainer: Any, seq_len: int, device: Any) -> tuple[int, float]:
    """(bytes kept between quanta, activation bytes per token), measured with 1 and 4 examples
    on CUDA (the quantum's peak above what was allocated before it)."""
    import torch

    if device.type != "cuda":
        trainer.step_quantum(max_tokens=seq_len)  # warm (lazy imports) outside the phases
        return 0, 64.0 * 1024  # CPU: budgets are accounting only
    peaks: dict[int, int] = {}
    for examples in (1, 4, 1, 4):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = trainer.step_quantum(max_tokens=examples * seq_len)
        torch.cuda.synchronize()
        # The larger of the two runs of each size: the first quantum of a trainer allocates
        # more (optimizer state, workspaces), and a phase's first quantum must fit too.
        peak = torch.cuda.max_memory_allocated() - before
        peaks[int(result.examples)] = max(peaks.get(int(result.examples), 0), peak)
    resident = torch.cuda.memory_allocated() - trainer_start_allocated(trainer)
    small, big = min(peaks), max(peaks)
    if big == small:
        raise RuntimeError(f"footprint quanta all ran {big} examples")
    per_token = (peaks[big] - peaks[small]) / ((big - small) * seq_len)
    return max(resident, 0) + int(peaks[small] - per_token * small * seq_len), per_token * 1.1


def trainer_start_allocated(trainer: Any) -> int:
    return int(getattr(trainer, "_bench_allocated_at_start", 0))


def _run_phase(
    name: str, args: Any, model: Any, trace: list[Any], prompts: list[list[int]], plan: dict
) -> dict[str, Any]:
    """One phase on a fresh pool; the pool is closed (and the device's cap lifted) even when
    the phase fails."""
    import torch

    from gpu_runtime.memory import create_page_pool

    cuda = args.device.startswith("cuda")
    pool = create_page_pool(
        device=args.device,
        pool_bytes=int(args.pool_gib * GIB),
        page_bytes=PAGE if cuda else plan["cpu_page_bytes"],
        pinned_tail_pages=1,
        torch_headroom_bytes=int(args.torch_headroom_gib * GIB),
    )
    try:
        return _drive_phase(name, args, model, trace, prompts, plan, pool)
    finally:
        pool.close()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _drive_phase(
    name: str,
    args: Any,
    model: Any,
    trace: list[Any],
    prompts: list[list[int]],
    plan: dict,
    pool: Any,
) -> dict[str, Any]:
    import torch

    from bench.colocate import synthetic_examples
    from gpu_runtime.colocation import HostLoop
    from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
    from gpu_runtime.finetune.hparams import LoraSpec, resolve_hyperparameters
    from gpu_runtime.finetune.trainer import LoraTrainer
    from gpu_runtime.memory import EngineMemory, MemoryPolicyConfig

    cuda = args.device.startswith("cuda")
    kv_dtype = "bfloat16" if cuda else "float32"
    page = pool.page_bytes
    static = name == "static_split"
    policy = MemoryPolicyConfig(
        reserve_low_pages=plan["reserve_low_pages"],
        reserve_high_pages=plan["reserve_high_pages"],
        max_step_pages=plan["step_pages"],
        shrink_after_iterations=10**9 if static else plan["hysteresis"],
        grow_hold_iterations=plan["hysteresis"],
        min_decode_pages=plan["static_decode_pages"] if static else 1,
        reclaim_from_finetune=not static,
    )
    memory = EngineMemory.prepare(
        pool,
        model.config,
        block_size=16,
        kv_dtype=kv_dtype,
        max_model_len=args.max_model_len,
        policy=policy,
    )
    engine = Engine(
        model,
        EngineConfig(
            num_kv_blocks=memory.binding.initial_blocks,
            kv_block_capacity=memory.binding.capacity_blocks,
            block_size=16,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_batched_tokens,
            max_model_len=args.max_model_len,
            device=args.device,
            cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        ),
        kv_storage_factory=memory.binding.storage_factory,
    )
    memory.attach(engine)
    sharing: Any = None
    decode_sms: int | None = None
    warm_stream: Any = None
    if cuda:
        # Decode on a high-priority stream, quanta on a low-priority one: on one stream the
        # decode step would queue behind the whole quantum.
        from gpu_runtime.sharing import StreamSharing

        sharing = StreamSharing(torch.device(args.device))
        decode_sms = int(sharing.table.total_sms)
        warm_stream = sharing.partition(decode_sms)[0]
        engine.capture_cuda_graphs(partition=decode_sms, stream=warm_stream)
    # Warm prefill and decode on decode's stream so their cached activations count as
    # decode's, not finetune's (the caching allocator keeps blocks per stream).
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
    with torch.cuda.stream(warm_stream) if cuda else _nothing():
        engine.generate([prompts[0][: args.max_batched_tokens]] * 2, warm)
        engine.generate([p[:256] for p in prompts[:16]], warm)
    if cuda:
        torch.cuda.synchronize()
    memory.decode_ready()
    print(f"[{name}] pool {pool.num_pages} pages, engine ready", flush=True)
    n_examples = 512
    hparams = resolve_hyperparameters(
        n_train_examples=n_examples,
        n_epochs=50,
        batch_size=8,
        lora=LoraSpec(rank=16, alpha=32, dropout=0.0),
        seed=args.seed,
        warmup_ratio=0.0,
        max_seq_len=args.ft_seq_len,
    )
    examples = synthetic_examples(n_examples, args.ft_seq_len, model.config.vocab_size, 1)
    trainer = LoraTrainer(model, examples, hparams)
    sizing = _QuantumSizing(plan["resident_bytes"], plan["bytes_per_token"], args.max_examples)
    loop = HostLoop(
        engine,
        _budgeted_policy(sizing, decode_sms),
        tpot_slo_ms=1e9,
        sharing=sharing,
        memory=memory,
    )
    executor = loop.executor
    memory.finetune_busy = lambda: executor.in_flight is not None
    memory.wait_for_finetune = lambda: executor.wait()
    memory.manager.set_finetune_demand(pool.num_pages * page)
    job = loop.add_job("ft", trainer)

    rejected = 0
    ooms = 0
    oom_details: list[dict[str, Any]] = []
    errors: list[str] = []
    kv_peak_blocks = 0
    series: list[tuple[float, float, float, float]] = []
    lent_samples: list[tuple[float, int]] = []
    records = []
    start = loop.clock()
    i = 0
    drain_until = args.duration + args.drain
    next_sample = 0.0
    try:
        while True:
            now = loop.clock() - start
            if now >= drain_until or (
                now >= args.duration and not engine.has_unfinished_requests()
            ):
                break
            while i < len(trace) and trace[i].arrival_s <= min(now, args.duration):
                r = trace[i]
                params = SamplingParams(
                    max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True, detokenize=False
                )
                try:
                    loop.add_request(prompts[i], params, f"r{r.index}", arrival=start + r.arrival_s)
                except ValueError:
                    rejected += 1
                i += 1
            record = loop.run_iteration()
            records.append(record)
            for report in record.quanta:
                if report.error is None:
                    continue
                if "out of memory" in report.error.lower():
                    # Count it, make the next quanta smaller, and let the job go on.
                    ooms += 1
                    if len(oom_details) < 5:
                        oom_details.append(
                            {
                                "t_s": round(loop.clock() - start, 3),
                                "budget_gib": round(memory.finetune_budget_bytes() / GIB, 3),
                                "quantum_ms": round(report.duration_ms, 1),
                                "error": report.error[:600],
                            }
                        )
                    memory.manager.record_finetune_oom()
                    sizing.safety *= 0.8
                    job.failed = None
                elif len(errors) < 5:
                    errors.append(report.error)
            kv_peak_blocks = max(kv_peak_blocks, engine.block_manager.num_used_blocks)
            lent = memory.lent_bytes()
            lent_samples.append((record.timestamp - start, lent))
            if now >= next_sample:
                next_sample = now + 0.25
                split = memory.manager.split()
                series.append(
                    (
                        round(now, 3),
                        round(lent / GIB, 3),
                        round(split.finetune_allocated_bytes / GIB, 3),
                        round(
                            engine.block_manager.num_used_blocks
                            * memory.manager.layout.block_bytes
                            / GIB,
                            3,
                        ),
                    )
                )
            if not (record.decode_batch or record.prefill_tokens):
                # Nothing to decode: wait for the quantum (or the next arrival), don't spin.
                until = trace[i].arrival_s if i < len(trace) else drain_until
                pause = min(max(until - (loop.clock() - start), 0.0), 0.005)
                if executor.in_flight is not None:
                    loop.wait_for_finetune(timeout_s=pause)
                else:
                    time.sleep(min(pause, 0.001))
    finally:
        end = loop.clock()
        loop.close()
    live = getattr(engine.scheduler, "requests", {})
    unfinished = len(live)
    preempted_live = sum(getattr(r, "num_preemptions", 0) for r in live.values())
    counters = memory.manager.counters
    with_decode = [r for r in records if r.decode_batch or r.prefill_tokens]
    iter_ms = sorted(r.iteration_ms for r in with_decode)
    step_ms = sorted(r.observed_ms for r in with_decode)
    decode_only_ms = sorted(r.iteration_ms for r in with_decode if not r.prefill_tokens)
    tpot = sorted(s for r in records for s in r.tpot_samples_ms)
    reports = [q for r in records for q in r.quanta]
    good = [q for q in reports if not q.error]
    finished = sum(len(r.finished) for r in records)
    window = max(end - start, 1e-9)
    lent_gib_s = sum(lent * (t1 - t0) for (t0, lent), (t1, _) in itertools.pairwise(lent_samples))
    span = lent_samples[-1][0] - lent_samples[0][0] if len(lent_samples) > 1 else 0.0
    accepted = i - rejected
    return {
        "model": args.model,
        "trace": "memory-bursty",
        "policy": "unified" if not static else "static_split",
        "ooms": ooms,
        "dropped_requests": rejected + max(accepted - finished - unfinished, 0),
        "rejected_requests": rejected,
        "arrived_requests": i,
        "finished_requests": finished,
        "unfinished_at_end": unfinished,
        "reclaim_ms_p50": _finite(counters.reclaim_latency.percentile_ms(50)),
        "reclaim_ms_p99": _finite(counters.reclaim_latency.percentile_ms(99)),
        "reclaims": len(counters.reclaim_latency),
        "flush_ms_p99": _finite(counters.flush_latency.percentile_ms(99)),
        "finetune_flushes": len(counters.flush_latency),
        "finetune_waits": counters.finetune_waits,
        "finetune_wait_ms_p99": _finite(counters.wait_latency.percentile_ms(99)),
        "decode_iter_ms_p50": _finite(_pct_sorted(iter_ms, 50)),
        "decode_iter_ms_p99": _finite(_pct_sorted(iter_ms, 99)),
        "decode_only_iter_ms_p50": _finite(_pct_sorted(decode_only_ms, 50)),
        "decode_only_iter_ms_p99": _finite(_pct_sorted(decode_only_ms, 99)),
        "decode_step_ms_p50": _finite(_pct_sorted(step_ms, 50)),
        # Does a quantum on the worker thread hold the decode step up? (same phase, same load)
        "decode_step_ms_p50_quantum_beside": _finite(
            _pct_sorted(sorted(r.observed_ms for r in with_decode if r.in_flight), 50)
        ),
        "decode_step_ms_p50_alone": _finite(
            _pct_sorted(sorted(r.observed_ms for r in with_decode if not r.in_flight), 50)
        ),
        "decode_iterations_alone": sum(1 for r in with_decode if not r.in_flight),
        "tpot_ms_p50": _finite(_pct_sorted(tpot, 50)),
        "tpot_ms_p99": _finite(_pct_sorted(tpot, 99)),
        "mean_borrowed_gb": (lent_gib_s / span / 1e9) if span else 0.0,
        "max_borrowed_gb": max((lent for _, lent in lent_samples), default=0) / 1e9,
        "finetune_tokens_per_s": sum(q.tokens for q in good) / window,
        "finetune_quanta": len(reports),
        "finetune_tokens_per_quantum_mean": (
            sum(q.tokens for q in good) / len(good) if good else 0.0
        ),
        "finetune_quantum_ms_p50": _finite(_pct_sorted(sorted(q.duration_ms for q in good), 50)),
        "finetune_paused_iterations": sum(1 for r in records if r.paused),
        "finetune_errors": errors,
        "oom_details": oom_details,
        "finetune_budget_violations": counters.finetune_budget_violations,
        "kv_peak_gb": kv_peak_blocks * memory.manager.layout.block_bytes / 1e9,
        "kv_peak_pages": memory.manager.layout.pages_for_blocks(kv_peak_blocks),
        "decode_preemptions": counters.preemptions,
        "preemptions_of_unfinished": preempted_live,
        "window_s": window,
        "iterations": len(records),
        "decode_iterations": len(with_decode),
        "counters": {k: _finite(v) for k, v in counters.as_dict().items()},
        "series_t_lent_gib_ft_alloc_gib_kv_gib": series,
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _finite(value: float) -> float | None:
    """JSON has no NaN: an empty statistic is null."""
    return None if value != value else value


def _pct_sorted(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(int(q / 100 * len(values)), len(values) - 1)]


def trace_benchmark(args: Any) -> Path:
    """`unified` first (it also measures decode's KV peak), then `static_split` reserving that
    peak plus the reserve for decode and lending the rest to finetuning for good. A phase that
    fails is recorded as a row with its error; the result file is written after each phase."""
    import gc

    import torch

    from bench.colocate import synthetic_examples
    from bench.traces import generate
    from gpu_runtime.finetune.hparams import LoraSpec, resolve_hyperparameters
    from gpu_runtime.finetune.trainer import LoraTrainer
    from gpu_runtime.model import ModelConfig, build_random_model

    wall = time.perf_counter()
    # Every move and preemption is counted in the rows; per-event log lines would flood.
    logging.getLogger("gpu_runtime.memory").setLevel(logging.CRITICAL)
    device = torch.device(args.device)
    tiny = args.model == "tiny"
    config = ModelConfig.preset(args.model)
    if config.max_position_embeddings < args.max_model_len:
        config = config.replace(max_position_embeddings=args.max_model_len)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model = build_random_model(config, seed=args.seed, device=device, dtype=dtype)
    spec = _trace_spec(tiny, args.duration, args.rate_scale)
    trace = generate(spec, args.seed)
    prompts = [r.prompt_ids(config.vocab_size) for r in trace]
    # Finetune footprint, measured once on a scratch trainer. Batches of 5 examples: quanta of
    # 1 and 4 examples never meet a batch boundary, and the second and fourth end with an
    # optimizer step (AdamW state included in what stays resident).
    hparams = resolve_hyperparameters(
        n_train_examples=64,
        n_epochs=1,
        batch_size=5,
        lora=LoraSpec(rank=16, alpha=32, dropout=0.0),
        seed=args.seed,
        warmup_ratio=0.0,
        max_seq_len=args.ft_seq_len,
    )
    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    scratch = LoraTrainer(
        model, synthetic_examples(64, args.ft_seq_len, config.vocab_size, args.seed), hparams
    )
    scratch._bench_allocated_at_start = allocated  # type: ignore[attr-defined]
    footprint_error = None
    try:
        resident, per_token = _finetune_footprint(scratch, args.ft_seq_len, device)
    except Exception as exc:  # size quanta from the H200 finetune bench instead: ~7 MiB/token
        footprint_error = f"{type(exc).__name__}: {exc}"
        print(f"footprint measurement failed ({footprint_error}); using 1 GiB + 8 MiB/token")
        resident, per_token = GIB, 8.0 * MIB
    del scratch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    plan: dict[str, Any] = {
        "resident_bytes": resident,
        "bytes_per_token": per_token,
        "reserve_low_pages": args.reserve_low_pages,
        "reserve_high_pages": args.reserve_high_pages,
        "step_pages": args.step_pages,
        "hysteresis": args.hysteresis,
        "cpu_page_bytes": 2
        * 16
        * config.num_hidden_layers
        * config.num_key_value_heads
        * config.head_dim
        * 4,
        "static_decode_pages": 1,
        "footprint_error": footprint_error,
    }
    print(
        f"setup {time.perf_counter() - wall:.1f}s: {len(trace)} requests; finetune resident "
        f"{resident / GIB:.2f} GiB, {per_token / 1024:.1f} KiB/token",
        flush=True,
    )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    today = dt.datetime.now(dt.UTC)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"memory-{_gpu_slug(gpu)}-{today:%Y%m%d}.json"
    rows: list[dict[str, Any]] = []

    def phase(name: str) -> None:
        started = time.perf_counter()
        try:
            rows.append(_run_phase(name, args, model, trace, prompts, plan))
        except Exception as exc:  # one phase's failure is a result; the other still runs
            import traceback

            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
            rows.append({"model": args.model, "policy": name, "error": error})
        print(f"[{name}] {time.perf_counter() - started:.1f} s", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _write_trace_result(path, args, spec, plan, rows, gpu, today, wall)

    phase("unified")
    unit = 16 if device.type == "cuda" else 1
    page = PAGE if device.type == "cuda" else plan["cpu_page_bytes"]
    if "kv_peak_pages" in rows[0]:
        peak_pages = rows[0]["kv_peak_pages"] + args.reserve_low_pages
    else:  # unified failed: reserve a fixed share of the pool for decode
        peak_pages = int(args.pool_gib * GIB * 0.6) // page
    prefix_limit = int(args.pool_gib * GIB) // (page * unit) * unit - unit  # less the tail
    plan["static_decode_pages"] = min(-(-peak_pages // unit) * unit, prefix_limit)
    phase("static_split")
    _print_trace_table(rows)
    return path


def _write_trace_result(
    path: Path,
    args: Any,
    spec: Any,
    plan: dict[str, Any],
    rows: list[dict[str, Any]],
    gpu: str,
    today: dt.datetime,
    wall: float,
) -> None:
    import torch

    by_policy = {row["policy"]: row for row in rows if "error" not in row}
    unified, static = by_policy.get("unified"), by_policy.get("static_split")
    comparisons: dict[str, float | None] = {}
    if unified is not None and static is not None:
        for key in ("mean_borrowed_gb", "finetune_tokens_per_s", "decode_iter_ms_p50"):
            comparisons[f"{key}_ratio_unified_over_static"] = _ratio(unified[key], static[key])
    result = {
        "name": "memory",
        "commit": _commit(),
        "gpu": gpu,
        "torch": torch.__version__,
        "created": today.isoformat(timespec="seconds"),
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "trace": spec.as_dict(),
            "finetune": {
                "lora_rank": 16,
                "alpha": 32,
                "seq_len": args.ft_seq_len,
                "resident_bytes": plan["resident_bytes"],
                "bytes_per_token": plan["bytes_per_token"],
                "footprint_error": plan["footprint_error"],
            },
            "static_decode_pages": plan["static_decode_pages"],
        },
        "rows": rows,
        "comparisons": comparisons,
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    path.write_text(json.dumps(result, indent=1, default=str))


def _print_trace_table(rows: list[dict[str, Any]]) -> None:
    keys = (
        "ooms",
        "dropped_requests",
        "unfinished_at_end",
        "reclaim_ms_p50",
        "reclaim_ms_p99",
        "decode_iter_ms_p50",
        "decode_iter_ms_p99",
        "tpot_ms_p50",
        "mean_borrowed_gb",
        "finetune_tokens_per_s",
    )
    print(f"{'policy':13}" + "".join(f"{k[:18]:>19}" for k in keys))
    for row in rows:
        if "error" in row:
            print(f"{row['policy']:13} FAILED {row['error']}", flush=True)
            continue
        cells = [row[k] for k in keys]
        text = ["-" if c is None else f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells]
        print(f"{row['policy']:13}" + "".join(f"{t:>19}" for t in text), flush=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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
    tr.add_argument("--pool-gib", type=float, default=80.0, help="pool size (KV + finetune)")
    tr.add_argument("--max-model-len", type=int, default=4096)
    tr.add_argument("--max-num-seqs", type=int, default=256)
    tr.add_argument("--max-batched-tokens", type=int, default=2048)
    tr.add_argument("--ft-seq-len", type=int, default=1024)
    tr.add_argument("--max-examples", type=int, default=4, help="most examples per quantum")
    tr.add_argument("--reserve-low-pages", type=int, default=1024)
    tr.add_argument("--reserve-high-pages", type=int, default=3072)
    tr.add_argument(
        "--torch-headroom-gib",
        type=float,
        default=3.0,
        help="torch memory decode may add after warm-up, outside the finetune budget",
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
        path = trace_benchmark(args)
        print(f"wrote {path}")
        return 0
    path = mechanism(args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
