"""The CUDA VMM measurements of `python -m bench.memory mechanism` (`mechanism.py` runs them):
map/unmap cost per 2 MiB page and per chunk size (`driver_costs`), that the KV view keeps its data
across remaps (`view_correctness`), whether map/unmap/empty_cache wait for in-flight kernels
(`in_flight`), that unmapped memory is usable by torch at once and the finetune cap holds
(`usable_at_once`), and the time to move 1 GiB between KV and torch (`move_one_gib`)."""

from __future__ import annotations

import time
from typing import Any

from bench.memory.recorder import GIB, MIB, PAGE, Recorder, median
from gpu_runtime.contract.statistics import percentile

CHUNK_SWEEP_MIB = (2, 8, 32, 128)


# ---- raw driver costs --------------------------------------------------------------------
def driver_costs(rec: Recorder, pages: int = 512, rounds: int = 3) -> None:
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
        rec.value("driver", f"{name}_per_2MiB_p50", median(samples) * 1e6, "us")
        p99 = percentile(samples, 99)
        rec.value("driver", f"{name}_per_2MiB_p99", None if p99 is None else p99 * 1e6, "us")
    gib = pages * PAGE / GIB
    for name, samples in totals.items():
        rec.value("driver", f"{name}_per_GiB", median(samples) / gib * 1e3, "ms")
    call(cu.cuMemAddressFree(cu.CUdeviceptr(base), 100 * GIB))
    probe.close()


def _range_view(address: int, nbytes: int) -> Any:
    from gpu_runtime.memory.cuda_backend import _DeviceRange

    return _DeviceRange(address, nbytes)


# ---- backend: view correctness, in-flight behaviour, moves --------------------------------
def view_correctness(rec: Recorder) -> None:
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


def in_flight(rec: Recorder) -> None:
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


def usable_at_once(rec: Recorder) -> None:
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


def move_one_gib(rec: Recorder, rounds: int = 5) -> None:
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
            rec.value("move", f"1GiB_{key}_p50", median(values) * 1e3, "ms", chunk_mib=chunk_mib)
        to_kv = [a + b for a, b in zip(samples["flush"], samples["map"], strict=True)]
        rec.value("move", "1GiB_torch_to_kv_max", max(to_kv) * 1e3, "ms", chunk_mib=chunk_mib)
