"""Build the unified pool for a device: CUDA virtual memory on GPUs, accounting on CPU."""

from __future__ import annotations

from gpu_runtime.memory.backend import CpuPageBackend
from gpu_runtime.memory.layout import CUDA_PAGE_BYTES, GIB
from gpu_runtime.memory.pool import PagePool


def create_page_pool(
    *,
    device: str,
    pool_bytes: int | None = None,
    page_bytes: int = CUDA_PAGE_BYTES,
    materialize_kv: bool = True,
    leave_free_bytes: int = 4 * GIB,
    torch_headroom_bytes: int = 1 * GIB,
) -> PagePool:
    """A `PagePool` on `device` ("cpu", "cuda" or "cuda:N").

    CUDA: the page size is the driver's granularity (2 MiB), `pool_bytes` defaults to the free
    device memory less `leave_free_bytes`; build it after the weights are loaded. CPU: the
    pool is `pool_bytes // page_bytes` pages of accounting, with a real host tensor as KV storage
    when `materialize_kv`. `page_bytes` is ignored on CUDA.
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
            )
        )
    if kind != "cpu" or index:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if pool_bytes is None:
        raise ValueError("a CPU pool needs pool_bytes")
    if pool_bytes < page_bytes:
        raise ValueError(f"pool_bytes {pool_bytes} is less than one page of {page_bytes} B")
    return PagePool(
        CpuPageBackend(
            num_pages=pool_bytes // page_bytes,
            page_bytes=page_bytes,
            materialize_kv=materialize_kv,
        )
    )
