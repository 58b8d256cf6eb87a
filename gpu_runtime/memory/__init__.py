"""Unified memory: one pool for the KV cache and finetune memory, decode first.

`PagePool` (ledger over a `PageBackend`: `CudaVmmBackend` on GPUs, `CpuPageBackend` on CPU) and
`MemoryManager` (watermarks, reclaim, hysteresis). See README.md in this directory.
"""

from gpu_runtime.memory.backend import CpuPageBackend, PageBackend
from gpu_runtime.memory.counters import LatencySamples, MemoryCounters
from gpu_runtime.memory.engine_memory import (
    EngineMemory,
    engine_kv_layout,
    scheduler_block_demand,
    scheduler_waiting_blocks,
)
from gpu_runtime.memory.factory import HostMemory, build_host_memory, create_page_pool
from gpu_runtime.memory.kv_binding import BlockManagerLike, KVPoolBinding
from gpu_runtime.memory.layout import (
    CUDA_PAGE_BYTES,
    FinetuneBudgetExceeded,
    KVLayout,
    MemoryPoolError,
    PhysicalMemoryUnavailable,
    kv_block_bytes,
)
from gpu_runtime.memory.manager import (
    DecodeDemand,
    DecodeGrant,
    MemoryManager,
    MemoryManagerConfig,
)
from gpu_runtime.memory.pool import MemorySplit, PagePool
from gpu_runtime.memory.work import MemoryWork

__all__ = [
    "BlockManagerLike",
    "KVPoolBinding",
    "CUDA_PAGE_BYTES",
    "CpuPageBackend",
    "DecodeDemand",
    "DecodeGrant",
    "EngineMemory",
    "HostMemory",
    "FinetuneBudgetExceeded",
    "KVLayout",
    "LatencySamples",
    "MemoryCounters",
    "MemoryManager",
    "MemoryManagerConfig",
    "MemoryPoolError",
    "MemorySplit",
    "MemoryWork",
    "PageBackend",
    "PagePool",
    "PhysicalMemoryUnavailable",
    "build_host_memory",
    "create_page_pool",
    "engine_kv_layout",
    "kv_block_bytes",
    "scheduler_block_demand",
    "scheduler_waiting_blocks",
]
