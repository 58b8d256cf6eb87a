"""CUDA backend: KV pages are 2 MiB physical chunks mapped into one reserved address range.

Mechanism (CUDA virtual memory management through `cuda-bindings`, imported lazily):
- `cuMemAddressReserve` reserves `num_pages * page_bytes` of address space once; the KV cache is
  a torch uint8 view of the whole range (`__cuda_array_interface__`), so its address never moves.
- Pages are 2 MiB (the driver's granularity, the accounting unit) but physical memory moves in
  chunks of `chunk_bytes` (default 32 MiB = 16 pages): each driver call costs about the same
  whatever the size, so 32 MiB chunks move 1 GiB many times faster than 2 MiB ones
  (docs/decisions/0016-reclaim-mechanism.md).
- Mapping a chunk: `cuMemCreate` + `cuMemMap`, then one `cuMemSetAccess` over the whole run of
  new chunks. Unmapping: `cuMemUnmap` + `cuMemRelease`, which returns the physical memory to the
  device at once (torch can allocate it right after). Neither waits for in-flight kernels.
- Finetune tensors come from torch's caching allocator. What is finetune's: the private pools
  created after `reset_baseline` (its graphs' pools and a `MemPool` for its eager state, see
  `torch_pools.py`), or, on a torch whose snapshots lack pool ids, all torch memory above the
  baseline (then decode's eager growth counts as finetune's). The budget is enforced as a cap
  on torch's reserved memory (`torch.cuda.set_per_process_memory_fraction`): the cap is what is
  not finetune's (the baseline: weights, decode buffers, taken at construction or
  `reset_baseline`, plus decode's growth since when pools are told apart) plus a headroom plus
  the finetune budget. Over the cap torch frees its cache and retries, then raises
  `torch.OutOfMemoryError` in the finetune quantum, never in a decode map. Lowering the budget
  below what finetune holds flushes the cache (`torch.cuda.empty_cache`) so the memory can be
  mapped for KV.
Only bytes of mapped pages may be touched through the view: anything else is a device fault.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from gpu_runtime.memory.layout import GIB, MIB, FinetuneBudgetExceeded, MemoryPoolError
from gpu_runtime.memory.torch_pools import FinetunePools, allocator_counters

if TYPE_CHECKING:
    import torch


class _DeviceRange:
    """Exposes a device address range to torch through the CUDA array interface (v3)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


class CudaVmmBackend:
    """Pages mapped and unmapped in a reserved virtual range; finetune capped inside torch."""

    def __init__(
        self,
        *,
        device: int = 0,
        pool_bytes: int | None = None,
        leave_free_bytes: int = 4 * GIB,
        torch_headroom_bytes: int = 1 * GIB,
        chunk_bytes: int = 32 * MIB,
        access_per_page: bool = False,
        finetune_pools: bool = True,
    ) -> None:
        """Reserve the range. `pool_bytes` defaults to the device's free memory less
        `leave_free_bytes` (room for decode's own torch allocations: graphs, workspace).
        `torch_headroom_bytes` is what torch may grow by beyond its baseline outside the
        finetune budget. `chunk_bytes` (a multiple of the granularity) is the map unit.
        `access_per_page` sets access per mapped chunk instead of once per mapped run (kept to
        compare the two by measurement). `finetune_pools`: count as finetune's only the private
        pools created after the baseline (when torch's snapshots allow it), not all growth."""
        import torch
        from cuda.bindings import driver as cu

        self._cu: Any = cu
        self._torch = torch
        self._device = device
        torch.cuda.set_device(device)
        torch.empty(1, device=f"cuda:{device}")  # makes the primary context current
        self._call(cu.cuInit(0))
        (ctx,) = self._call(cu.cuCtxGetCurrent())
        if int(ctx) == 0:
            (dev,) = self._call(cu.cuDeviceGet(device))
            (ctx,) = self._call(cu.cuDevicePrimaryCtxRetain(dev))
            self._call(cu.cuCtxSetCurrent(ctx))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        (granularity,) = self._call(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            )
        )
        self._page_bytes = int(granularity)
        if chunk_bytes <= 0 or chunk_bytes % self._page_bytes:
            raise MemoryPoolError(
                f"chunk_bytes {chunk_bytes} is not a multiple of the granularity {self._page_bytes}"
            )
        self._chunk_bytes = chunk_bytes
        self._unit = chunk_bytes // self._page_bytes
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._access_per_page = access_per_page
        if pool_bytes is None:
            free, _total = torch.cuda.mem_get_info(device)
            pool_bytes = free - leave_free_bytes
        if pool_bytes < chunk_bytes:
            raise MemoryPoolError(f"pool of {pool_bytes} B is smaller than one chunk")
        self._num_pages = (pool_bytes // chunk_bytes) * self._unit
        self._range_bytes = self._num_pages * self._page_bytes
        (base,) = self._call(cu.cuMemAddressReserve(self._range_bytes, self._page_bytes, 0, 0))
        self._base = int(base)
        self._handles: dict[int, Any] = {}
        self._view: torch.Tensor | None = None
        self._total_bytes = torch.cuda.get_device_properties(device).total_memory
        self._torch_headroom_bytes = torch_headroom_bytes
        self._cap_bytes = 0
        self._decode_reserved = 0
        pools = FinetunePools(torch, device) if finetune_pools else None
        self._pools = pools if pools is not None and pools.available else None
        self.reset_baseline()
        self._closed = False

    # ---- driver helpers ----------------------------------------------------------------
    def _call(self, result: Any) -> tuple[Any, ...]:
        """Check a cuda-bindings result tuple `(CUresult, *values)`; return the values."""
        cu = self._cu
        err = result[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            _, name = cu.cuGetErrorName(err)
            text = name.decode() if isinstance(name, bytes) else str(name)
            raise MemoryPoolError(f"CUDA driver call failed: {text} ({int(err)})")
        return tuple(result[1:])

    def _address(self, slot: int) -> Any:
        return self._cu.CUdeviceptr(self._base + slot * self._page_bytes)

    # ---- PageBackend -------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def map_unit_pages(self) -> int:
        return self._unit

    def map_range(self, first: int, count: int) -> int:
        self._check_range(first, count)
        cu = self._cu
        unit = self._unit
        chunks = range(first, first + count, unit)
        for slot in chunks:
            if slot in self._handles:
                raise MemoryPoolError(f"slot {slot} is already mapped")
        mapped = 0
        for slot in chunks:
            result = cu.cuMemCreate(self._chunk_bytes, self._prop, 0)
            if result[0] == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                break
            (handle,) = self._call(result)
            try:
                self._call(cu.cuMemMap(self._address(slot), self._chunk_bytes, 0, handle, 0))
            except MemoryPoolError:
                self._call(cu.cuMemRelease(handle))
                raise
            self._handles[slot] = handle
            mapped += unit
            if self._access_per_page:
                address = self._address(slot)
                self._call(cu.cuMemSetAccess(address, self._chunk_bytes, self._access, 1))
        if mapped and not self._access_per_page:
            # One access call for the whole newly mapped run (a range of several mappings).
            nbytes = mapped * self._page_bytes
            self._call(cu.cuMemSetAccess(self._address(first), nbytes, self._access, 1))
        return mapped

    def unmap_range(self, first: int, count: int) -> None:
        self._check_range(first, count)
        cu = self._cu
        chunks = range(first, first + count, self._unit)
        for slot in chunks:
            if slot not in self._handles:
                raise MemoryPoolError(f"slot {slot} is not mapped")
        for slot in chunks:
            self._call(cu.cuMemUnmap(self._address(slot), self._chunk_bytes))
            self._call(cu.cuMemRelease(self._handles.pop(slot)))

    def mapped_slots(self) -> frozenset[int]:
        unit = self._unit
        return frozenset(page for slot in self._handles for page in range(slot, slot + unit))

    def kv_storage(self) -> torch.Tensor:
        """The uint8 view of the whole range; needs slot 0 mapped when first called."""
        if self._view is None:
            if 0 not in self._handles:
                raise MemoryPoolError("map slot 0 before taking the KV view")
            self._view = self._torch.as_tensor(
                _DeviceRange(self._base, self._range_bytes), device=f"cuda:{self._device}"
            )
        return self._view

    def set_finetune_cap(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise MemoryPoolError(f"finetune cap must be >= 0, got {budget_bytes}")
        self._cap_bytes = budget_bytes
        self._apply_cap()

    def _apply_cap(self) -> None:
        decode = max(self._baseline_reserved, self._decode_reserved)
        limit = decode + self._torch_headroom_bytes + self._cap_bytes
        fraction = min(limit / self._total_bytes, 1.0)
        self._torch.cuda.set_per_process_memory_fraction(fraction, self._device)

    @property
    def finetune_accounting(self) -> str:
        """`pools` (finetune's own private pools) or `process` (all torch growth)."""
        return "pools" if self._pools is not None else "process"

    def finetune_allocations(self) -> AbstractContextManager[None]:
        """Route this thread's allocations into finetune's `MemPool` (no-op without pools)."""
        return self._pools.allocations() if self._pools is not None else nullcontext()

    def reset_baseline(self) -> None:
        """Take torch's current reserved/allocated bytes as not-finetune (call after decode
        warm-up and graph capture, while no finetune tensor is alive)."""
        cuda = self._torch.cuda
        self._baseline_reserved = cuda.memory_reserved(self._device)
        self._baseline_allocated = cuda.memory_allocated(self._device)
        self._decode_reserved = self._baseline_reserved
        if self._pools is not None:
            self._pools.reset_baseline()
        self.set_finetune_cap(self._cap_bytes)

    def finetune_baseline_bytes(self) -> int:
        return int(self._baseline_allocated)

    def finetune_reserved_bytes(self) -> int:
        if self._pools is None:
            reserved = self._torch.cuda.memory_reserved(self._device)
            return max(reserved - self._baseline_reserved, 0)
        finetune, total = self._pools.refresh()
        decode = total - finetune
        if decode != self._decode_reserved:  # decode's own growth moves the cap with it
            self._decode_reserved = decode
            self._apply_cap()
        return finetune

    def allocator_stats(self) -> dict[str, int]:
        """torch's allocator now (`torch_pools.allocator_counters`): segments, reserved bytes and
        cumulative device calls, syncs, retries. With finetune pools, as of the last
        `finetune_reserved_bytes()` (which `EngineMemory.after_decode` calls every iteration):
        no extra read."""
        if self._pools is not None and self._pools.last_counters:
            return dict(self._pools.last_counters)
        return allocator_counters(self._torch.cuda.memory_stats_as_nested_dict(self._device))

    def finetune_allocated_bytes(self) -> int:
        allocated = self._torch.cuda.memory_allocated(self._device)
        return max(allocated - self._baseline_allocated, 0)

    def record_finetune_usage(self, *, peak_bytes: int, resident_bytes: int) -> None:
        if peak_bytes < 0 or resident_bytes < 0 or resident_bytes > peak_bytes:
            raise MemoryPoolError(
                f"need 0 <= resident_bytes <= peak_bytes, got {resident_bytes}, {peak_bytes}"
            )
        if peak_bytes > self._cap_bytes:
            raise FinetuneBudgetExceeded(
                f"finetune peak {peak_bytes} B exceeds its cap {self._cap_bytes} B"
            )

    def release_finetune_cache(self) -> int:
        self._torch.cuda.empty_cache()
        return self.finetune_reserved_bytes()

    def close(self) -> None:
        if self._closed:
            return
        cu = self._cu
        self._view = None
        for slot in sorted(self._handles):
            self._call(cu.cuMemUnmap(self._address(slot), self._chunk_bytes))
            self._call(cu.cuMemRelease(self._handles.pop(slot)))
        self._call(cu.cuMemAddressFree(self._cu.CUdeviceptr(self._base), self._range_bytes))
        self._torch.cuda.set_per_process_memory_fraction(1.0, self._device)
        self._closed = True

    def _check_range(self, first: int, count: int) -> None:
        if self._closed:
            raise MemoryPoolError("backend is closed")
        if count < 0 or first < 0 or first + count > self._num_pages:
            raise MemoryPoolError(
                f"slot range [{first}, {first + count}) outside [0, {self._num_pages})"
            )
        if first % self._unit or count % self._unit:
            raise MemoryPoolError(
                f"slot range [{first}, {first + count}) is not aligned to {self._unit} pages"
            )
