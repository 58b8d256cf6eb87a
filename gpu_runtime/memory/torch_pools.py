"""Which of torch's CUDA memory is finetune's: the private pools created after decode was ready.

Torch's caching allocator keeps memory per pool: the default pool, one private pool per set of
CUDA graphs, and any `torch.cuda.MemPool`. Decode's own memory is the default pool (weights,
buffers, its eager prefill activations, which grow after warm-up) and the private pools of its
graphs, captured before `reset_baseline`. Finetune's is every private pool created after it: the
trainers' graph pools (a graphed quantum allocates nothing else) and `FinetunePools.mempool`, a
`torch.cuda.MemPool` the finetune side routes its eager allocations into
(`with pools.allocations(): ...`; torch routes the current thread only, so an eager backward
that the autograd engine runs on its own device thread still allocates in the default pool).
Counting only those keeps decode's eager growth out of the finetune figure that decides whether
a reclaim must flush the cache (counted as finetune's, it could force a flush).

The figure comes from an allocator snapshot (`torch.cuda.memory_snapshot`, segments tagged with
their pool), which costs a pass over every segment, so it is cached and taken again only when
the allocator created or freed a segment since (its cumulative segment counters): replays,
tensor allocations inside cached segments and decode's steady state leave it unchanged.
Without pool ids in the snapshot (an older torch) `available` is False and the caller falls
back to the process-wide figure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

PoolId = tuple[int, int]
DEFAULT_POOL: PoolId = (0, 0)

_EVENT_COUNTERS = {
    "device_allocs": "num_device_alloc",
    "device_frees": "num_device_free",
    "alloc_retries": "num_alloc_retries",
    "sync_all_streams": "num_sync_all_streams",
    "ooms": "num_ooms",
}


def allocator_counters(stats: dict[str, Any]) -> dict[str, int]:
    """From `torch.cuda.memory_stats_as_nested_dict`: the segments and reserved bytes now, and
    the allocator's cumulative device calls (cudaMalloc/cuMemMap, cudaFree/cuMemUnmap: a
    cudaFree waits for the whole device), retries after a failed cudaMalloc (each a cache
    flush), `synchronize_and_free_events` calls and OOMs (0 where this torch lacks one)."""
    out = {
        "segments": int(stats.get("segment", {}).get("all", {}).get("current", 0)),
        "reserved_bytes": int(stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)),
    }
    for name, key in _EVENT_COUNTERS.items():
        out[name] = int(stats.get(key, 0))
    return out


class FinetunePools:
    """Reserved bytes of the finetune pools, and a `MemPool` for finetune's eager tensors."""

    def __init__(self, torch_module: Any, device: int) -> None:
        self._torch = torch_module
        self._device = device
        self._baseline_pools: frozenset[PoolId] = frozenset({DEFAULT_POOL})
        self._key: tuple[int, int] | None = None
        self._finetune_reserved = 0
        self._total_reserved = 0
        self._mempool: Any = None
        self.last_counters: dict[str, int] = {}
        """`allocator_counters` as of the last `refresh` (read there anyway)."""
        self.snapshots = 0
        """Snapshots taken (each is a pass over every segment: should stay rare)."""
        self.available = self._probe()

    def _probe(self) -> bool:
        try:
            segments = self._segments()
        except Exception:  # an allocator without snapshots: the caller falls back
            return False
        return all("segment_pool_id" in segment for segment in segments)

    def _segments(self) -> list[dict[str, Any]]:
        segments = self._torch.cuda.memory_snapshot()
        return [s for s in segments if int(s.get("device", self._device)) == self._device]

    @staticmethod
    def _pool_id(segment: dict[str, Any]) -> PoolId:
        first, second = segment["segment_pool_id"]
        return int(first), int(second)

    def reset_baseline(self) -> None:
        """Every pool that holds memory now (the default pool, decode's graph pools) is not
        finetune's; pools created later are."""
        pools = {self._pool_id(s) for s in self._segments()}
        if self._mempool is not None:
            pools.discard(tuple(self._mempool.id))
        self._baseline_pools = frozenset(pools | {DEFAULT_POOL})
        self._key = None

    def _segment_key(self) -> tuple[int, int, int]:
        stats = self._torch.cuda.memory_stats_as_nested_dict(self._device)
        self.last_counters = allocator_counters(stats)
        segment = stats.get("segment", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)
        return int(segment.get("allocated", 0)), int(segment.get("freed", 0)), int(reserved)

    def refresh(self) -> tuple[int, int]:
        """(finetune reserved bytes, all reserved bytes), from the cache unless a segment was
        created or freed since the last snapshot."""
        allocated, freed, reserved = self._segment_key()
        if self._key != (allocated, freed):
            finetune = 0
            for segment in self._segments():
                if self._pool_id(segment) not in self._baseline_pools:
                    finetune += int(segment["total_size"])
            self._finetune_reserved = finetune
            self._key = (allocated, freed)
            self.snapshots += 1
        self._total_reserved = reserved
        return self._finetune_reserved, reserved

    def finetune_reserved_bytes(self) -> int:
        return self.refresh()[0]

    @property
    def mempool(self) -> Any:
        """The finetune side's `torch.cuda.MemPool` (created on first use)."""
        if self._mempool is None:
            self._mempool = self._torch.cuda.MemPool()
        return self._mempool

    @contextlib.contextmanager
    def allocations(self) -> Iterator[None]:
        """Route this thread's allocations into the finetune `MemPool` (long-lived finetune
        state: adapters, gradients, optimizer state; a live pool's free cache is not returned
        by `torch.cuda.empty_cache`, so transient activations belong in graphs)."""
        torch = self._torch
        use = getattr(torch.cuda, "use_mem_pool", None)
        if use is None or not hasattr(torch.cuda, "MemPool"):
            yield
            return
        with use(self.mempool, self._device):
            yield
