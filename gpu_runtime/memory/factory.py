"""Build the unified pool for a device (CUDA virtual memory on GPUs, accounting on CPU), and the
whole host wiring (`build_host_memory` -> `HostMemory`) for a host agent's engine and loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gpu_runtime.finetune.shape_release import release_largest_separate
from gpu_runtime.memory.backend import CpuPageBackend
from gpu_runtime.memory.config import MemoryManagerConfig
from gpu_runtime.memory.engine_memory import EngineMemory, engine_kv_layout
from gpu_runtime.memory.layout import CUDA_PAGE_BYTES, GIB, MIB
from gpu_runtime.memory.manager import MemoryManager
from gpu_runtime.memory.pool import MemorySplit, PagePool


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
    finetune_pools: bool = True,
) -> PagePool:
    """A `PagePool` on `device` ("cpu", "cuda" or "cuda:N").

    CUDA: the page size is the driver's granularity (2 MiB), `pool_bytes` defaults to the free
    device memory less `leave_free_bytes`; build it after the weights are loaded. CPU: the
    pool is `pool_bytes // page_bytes` pages of accounting, with a real host tensor as KV storage
    when `materialize_kv`. `page_bytes` and `map_unit_pages` apply to CPU only; on CUDA the map
    unit is `chunk_bytes` (32 MiB by default: see README.md for the measurement).
    `pinned_tail_pages` stay mapped at the end of the KV range (the engine's padding block).
    `finetune_pools` (CUDA): finetune memory is its own private pools (its graphs' pools and a
    `MemPool`), not all torch growth after the baseline (see `torch_pools.py`).
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
                finetune_pools=finetune_pools,
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


class HostMemory:
    """The unified pool of one decode host, wired for its engine and its host loop.

    Built by `build_host_memory`; the host then builds its `Engine` with `engine_config` and
    `storage_factory`, calls `attach(engine)`, captures the engine's CUDA graphs, calls
    `decode_ready()`, builds its `HostLoop` with `memory=host_memory.memory`, and calls
    `bind_loop(loop)`. `set_finetune_jobs(n)` whenever the number of finetune jobs on the loop
    changes (the pool lends idle pages only while a job exists, and takes them back when none
    does). The loop's policy reads `ctx.finetune_budget_bytes` and must size every quantum to it
    (on CUDA an over-budget allocation raises `torch.OutOfMemoryError` inside the quantum).
    """

    def __init__(self, pool: PagePool, memory: EngineMemory, engine_config: Any) -> None:
        self.pool = pool
        self.memory = memory
        self.engine_config = engine_config
        """The host's `EngineConfig` with `num_kv_blocks` and `kv_block_capacity` set from the
        pool: build the engine with exactly this."""

    @property
    def storage_factory(self) -> Callable[..., Any]:
        """The engine's `kv_storage_factory`: a view of the pool's reserved KV range."""
        return self.memory.binding.storage_factory

    @property
    def manager(self) -> MemoryManager:
        return self.memory.manager

    def attach(self, engine: Any) -> None:
        """Bind the engine built with `engine_config` and `storage_factory`."""
        self.memory.attach(engine)

    def decode_ready(self) -> None:
        """After the engine's warm-up and CUDA-graph capture, before any finetune tensor."""
        self.memory.decode_ready()

    def bind_loop(self, loop: Any) -> None:
        """Let the pool see the loop's in-flight quantum (`HostLoop.executor`): reclaims then
        happen between quanta and never cut a running quantum's budget; a reclaim that must
        flush the finetune cache first drops the loop's trainers' CUDA graphs. A loop built with
        `release_graph_shapes` (the agent's) also gets the manager's release hook: between
        quanta, when decode's growth leaves what finetune holds above the release plan, the
        largest shape its jobs pool on their own is dropped and flushed
        (`release_largest_separate`), the shared pool kept."""
        executor = loop.executor
        self.memory.finetune_busy = lambda: executor.in_flight is not None
        self.memory.wait_for_finetune = lambda: executor.wait()

        def release_graphs() -> None:  # a flush cannot return CUDA graphs' private pools
            for job_id in loop.job_ids:
                trainer = loop.job_state(job_id).trainer
                release = getattr(trainer, "release_cuda_graphs", None)
                if release is not None:
                    release()

        self.pool.before_flush = release_graphs
        if loop.jobs.release_graph_shapes:  # one separate shape per release

            def trainers() -> list[Any]:
                return [loop.job_state(job_id).trainer for job_id in loop.job_ids]

            self.manager.finetune.graph_release = lambda: release_largest_separate(trainers())

    def set_finetune_jobs(self, count: int) -> None:
        """`count` finetune jobs on the loop: with any, finetuning may borrow every page decode
        does not need; with none, its budget goes back to the pool."""
        if count < 0:
            raise ValueError(f"job count must be >= 0, got {count}")
        page_bytes = self.pool.page_bytes
        self.memory.manager.finetune.set_demand(self.pool.num_pages * page_bytes if count else 0)

    def split(self) -> MemorySplit:
        """Decode / finetune / free bytes now (for heartbeats and metrics)."""
        return self.pool.split()

    def close(self) -> None:
        """Release the pool (unmap everything, lift the finetune cap); engine unusable after."""
        self.pool.close()


def build_host_memory(
    model: Any,
    engine_config: Any,
    *,
    pool_bytes: int | None = None,
    config: MemoryManagerConfig | None = None,
    leave_free_bytes: int = 4 * GIB,
    torch_headroom_bytes: int = 1 * GIB,
) -> HostMemory:
    """The unified pool for a host serving `model` with `engine_config` (an `EngineConfig`).

    Call it after the weights (and the engine's LoRA runtime, if any) are on the device.
    CUDA (`engine_config.device` "cuda" or "cuda:N"): a `CudaVmmBackend` over `pool_bytes`
    (default: the device's free memory less `leave_free_bytes`, which decode's own torch
    allocations, CUDA graphs included, must fit in), 2 MiB pages, 32 MiB map chunks, the finetune
    budget capped inside torch's caching allocator with `torch_headroom_bytes` of extra room for
    decode's torch allocations after `decode_ready()`. CPU: an accounting pool of `pool_bytes`
    (required) with one KV block per page and a real host tensor as KV storage. The KV dtype is
    `engine_config.kv_dtype` or the model's weight dtype; decode always keeps room for one request
    of `engine_config.max_model_len` tokens.
    """
    dtype = engine_config.kv_dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
    device = str(engine_config.device)
    cuda = device.startswith("cuda")
    layout = engine_kv_layout(
        model.local_config, block_size=engine_config.block_size, dtype=dtype, page_bytes=1
    )
    if cuda:
        pool = create_page_pool(
            device=device,
            pool_bytes=pool_bytes,
            leave_free_bytes=leave_free_bytes,
            torch_headroom_bytes=torch_headroom_bytes,
            pinned_tail_pages=-(-2 * layout.block_bytes // CUDA_PAGE_BYTES),
        )
    else:
        if pool_bytes is None:
            raise ValueError("a CPU host pool needs pool_bytes")
        pool = create_page_pool(
            device=device, pool_bytes=pool_bytes, page_bytes=layout.block_bytes, pinned_tail_pages=2
        )
    try:
        memory = EngineMemory.prepare(
            pool,
            model.local_config,
            block_size=engine_config.block_size,
            kv_dtype=dtype,
            max_model_len=engine_config.max_model_len,
            config=config,
        )
    except Exception:
        pool.close()
        raise
    config = dataclasses.replace(engine_config, **memory.engine_config_fields())
    return HostMemory(pool, memory, config)
