"""Build the unified pool for a device: CUDA virtual memory on GPUs, accounting on CPU."""

from __future__ import annotations

from gpu_runtime.memory.backend import CpuPageBackend
from gpu_runtime.memory.layout import CUDA_PAGE_BYTES, GIB, MIB
from gpu_runtime.memory.pool import PagePool


def create_page_pool(
    *,
    device: str,
    pool_bytes: int | None = None,
    page_bytes: int = CUDA_PAGE_BYTES,
    materialize_kv: bool = True,
    leave_free_bytes: int = 4 * GIB,
    torch_headroom_bytes: int = 1 * GIB,
    chunk_bytes: int = 32 * MIB,
    map_unit_pages: int = 1,
    pinned_tail_pages: int = 0,
) -> PagePool:
    """A `PagePool` on `device` ("cpu", "cuda" or "cuda:N").

    CUDA: the page size is the driver's granularity (2 MiB), `pool_bytes` defaults to the free
    device memory less `leave_free_bytes`; build it after the weights are loaded. CPU: the
    pool is `pool_bytes // page_bytes` pages of accounting, with a real host tensor as KV storage
    when `materialize_kv`. `page_bytes` and `map_unit_pages` apply to CPU only; on CUDA the map
    unit is `chunk_bytes` (32 MiB by default: see README.md for the measurement).
    `pinned_tail_pages` stay mapped at the end of the KV range (the engine's padding block).
    """
    kind, _, index = device.partition(":")
    if kind == "cuda":
        from gpu_runtime.memory.cuda_backend import CudaVmmBackend

        return PagePool(
            CudaVmmBackend(
                device=int(index or 0),
                pool_bytes=pool_bytes,
                leave_free_bytes=leave_free_bytes,
                torch_headroom_bytes=torch_headroom_bytes,
                chunk_bytes=chunk_bytes,
            ),
            pinned_tail_pages=pinned_tail_pages,
        )
    if kind != "cpu" or index:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if pool_bytes is None:
        raise ValueError("a CPU pool needs pool_bytes")
    if pool_bytes < page_bytes:
        raise ValueError(f"pool_bytes {pool_bytes} is less than one page of {page_bytes} B")
    num_pages = (pool_bytes // (page_bytes * map_unit_pages)) * map_unit_pages
    if num_pages == 0:
        raise ValueError(f"pool_bytes {pool_bytes} holds no whole map unit")
    return PagePool(
        CpuPageBackend(
            num_pages=num_pages,
            page_bytes=page_bytes,
            materialize_kv=materialize_kv,
            map_unit_pages=map_unit_pages,
        ),
        pinned_tail_pages=pinned_tail_pages,
    )
