"""The mechanism under the pool: who really holds physical memory.

A backend owns `num_pages` pages of physical memory and a KV byte range of as many page slots.
Decode's pages are slots of that range with physical memory mapped under them; the finetune side
holds physical memory through its own allocator, capped by a byte budget. `PagePool` keeps the
accounting and calls the backend to move memory; the backend reports the physical truth the
invariant checks compare against.

`CpuPageBackend` is the accounting implementation used by CI and by CPU runs: it simulates
physical pages one by one (so "no page owned twice" is checked on page ids), a caching finetune
allocator with a cap, and optionally a real host tensor as KV storage (poisoned on unmap, so a
read of an unmapped block shows up as NaN).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

from gpu_runtime.memory.layout import (
    FinetuneBudgetExceeded,
    MemoryPoolError,
    PhysicalMemoryUnavailable,
)

if TYPE_CHECKING:
    import torch

POISON_BYTE = 0xFF
"""Fill of unmapped CPU KV pages: all-ones bytes are NaN in bf16, fp16 and fp32."""


class PageBackend(Protocol):
    """Physical memory under the unified pool (CUDA virtual memory, or CPU accounting)."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (the map/unmap unit)."""
        ...

    @property
    def num_pages(self) -> int:
        """Pages of physical memory the pool owns; also the number of KV slots."""
        ...

    @property
    def map_unit_pages(self) -> int:
        """Pages mapped or unmapped together (one physical chunk); ranges align to it."""
        ...

    def map_range(self, first: int, count: int) -> int:
        """Back KV slots `[first, first+count)` with physical memory, in order.

        `first` and `count` are multiples of `map_unit_pages`. Returns how many slots were
        mapped: fewer than `count` only when the device ran out of physical memory (the mapped
        ones form a unit-aligned prefix of the range). Mapped slots must be unmapped before;
        anything else raises `MemoryPoolError`.
        """
        ...

    def unmap_range(self, first: int, count: int) -> None:
        """Unmap KV slots `[first, first+count)` (unit-aligned) and give the memory back."""
        ...

    def mapped_slots(self) -> frozenset[int]:
        """Slots that have physical memory under them now."""
        ...

    def kv_storage(self) -> torch.Tensor:
        """A uint8 tensor over all `num_pages * page_bytes` bytes of the KV range.

        Only bytes of mapped slots may be touched; on CUDA a touch elsewhere is a device fault.
        """
        ...

    def set_finetune_cap(self, budget_bytes: int) -> None:
        """Cap the finetune allocator's physical memory (reserved bytes) at `budget_bytes`."""
        ...

    def finetune_reserved_bytes(self) -> int:
        """Physical bytes the finetune allocator holds now (live tensors plus its cache)."""
        ...

    def finetune_allocations(self) -> AbstractContextManager[None]:
        """A context in which this thread's allocations are the finetune side's (CUDA: its own
        `torch.cuda.MemPool`); for its long-lived state (adapters, gradients, optimizer)."""
        ...

    def finetune_baseline_bytes(self) -> int:
        """Bytes of live non-finetune tensors at the last `reset_baseline` (0 on CPU): what a
        process-wide allocation figure must be reduced by to give finetune's share."""
        ...

    def reset_baseline(self) -> None:
        """Count what the process allocated so far (weights, decode buffers, CUDA graphs) as
        not finetune's. Call after decode warm-up, while no finetune tensor is alive."""
        ...

    def finetune_allocated_bytes(self) -> int:
        """Bytes of live finetune tensors now (what survives between quanta)."""
        ...

    def record_finetune_usage(self, *, peak_bytes: int, resident_bytes: int) -> None:
        """Account one finished finetune quantum: its peak and what it keeps.

        Raises `FinetuneBudgetExceeded` when the peak exceeded the cap.
        """
        ...

    def release_finetune_cache(self) -> int:
        """Return the finetune allocator's unused cache to the device; returns reserved after."""
        ...

    def close(self) -> None:
        """Unmap everything and release the address range; the backend is unusable after."""
        ...


class CpuPageBackend:
    """Accounting backend: physical pages are simulated ids, KV storage optionally real."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_bytes: int,
        materialize_kv: bool = False,
        map_unit_pages: int = 1,
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if map_unit_pages <= 0 or num_pages % map_unit_pages:
            raise ValueError(
                f"map_unit_pages ({map_unit_pages}) must be positive and divide "
                f"num_pages ({num_pages})"
            )
        self._unit = map_unit_pages
        self._num_pages = num_pages
        self._page_bytes = page_bytes
        # Physical page ids 0..num_pages-1; lowest id handed out first (deterministic).
        self._free_physical: list[int] = list(range(num_pages - 1, -1, -1))
        self._slot_to_physical: dict[int, int] = {}
        self._finetune_physical: list[int] = []
        self._finetune_cap_bytes = 0
        self._finetune_allocated_bytes = 0
        self._storage: torch.Tensor | None = None
        if materialize_kv:
            import torch

            self._storage = torch.full((num_pages * page_bytes,), POISON_BYTE, dtype=torch.uint8)
        self._closed = False

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def map_unit_pages(self) -> int:
        return self._unit

    def _check_open(self) -> None:
        if self._closed:
            raise MemoryPoolError("backend is closed")

    def _check_range(self, first: int, count: int) -> None:
        if count < 0 or first < 0 or first + count > self._num_pages:
            raise MemoryPoolError(
                f"slot range [{first}, {first + count}) outside [0, {self._num_pages})"
            )
        if first % self._unit or count % self._unit:
            raise MemoryPoolError(
                f"slot range [{first}, {first + count}) is not aligned to {self._unit} pages"
            )

    def map_range(self, first: int, count: int) -> int:
        self._check_open()
        self._check_range(first, count)
        for slot in range(first, first + count):
            if slot in self._slot_to_physical:
                raise MemoryPoolError(f"slot {slot} is already mapped")
        for done in range(0, count, self._unit):
            if len(self._free_physical) < self._unit:
                return done
            for slot in range(first + done, first + done + self._unit):
                self._slot_to_physical[slot] = self._free_physical.pop()
        return count

    def unmap_range(self, first: int, count: int) -> None:
        self._check_open()
        self._check_range(first, count)
        for slot in range(first, first + count):
            if slot not in self._slot_to_physical:
                raise MemoryPoolError(f"slot {slot} is not mapped")
        for slot in range(first, first + count):
            self._free_physical.append(self._slot_to_physical.pop(slot))
            if self._storage is not None:
                start = slot * self._page_bytes
                self._storage[start : start + self._page_bytes] = POISON_BYTE
        self._free_physical.sort(reverse=True)

    def mapped_slots(self) -> frozenset[int]:
        return frozenset(self._slot_to_physical)

    def kv_storage(self) -> torch.Tensor:
        if self._storage is None:
            raise MemoryPoolError("this CpuPageBackend was built with materialize_kv=False")
        return self._storage

    def set_finetune_cap(self, budget_bytes: int) -> None:
        self._check_open()
        if budget_bytes < 0:
            raise MemoryPoolError(f"finetune cap must be >= 0, got {budget_bytes}")
        self._finetune_cap_bytes = budget_bytes

    def finetune_reserved_bytes(self) -> int:
        return len(self._finetune_physical) * self._page_bytes

    def reset_baseline(self) -> None:
        """Nothing to do: the simulated finetune allocator holds only what was recorded."""
        self._check_open()

    def finetune_baseline_bytes(self) -> int:
        return 0

    def finetune_allocations(self) -> AbstractContextManager[None]:
        """Nothing to route: the simulated allocator holds only what was recorded."""
        return nullcontext()

    def finetune_allocated_bytes(self) -> int:
        return self._finetune_allocated_bytes

    def record_finetune_usage(self, *, peak_bytes: int, resident_bytes: int) -> None:
        """Simulate a caching allocator: the cache grows to the peak and stays until released."""
        self._check_open()
        if peak_bytes < 0 or resident_bytes < 0 or resident_bytes > peak_bytes:
            raise MemoryPoolError(
                f"need 0 <= resident_bytes <= peak_bytes, got {resident_bytes}, {peak_bytes}"
            )
        if peak_bytes > self._finetune_cap_bytes:
            raise FinetuneBudgetExceeded(
                f"finetune peak {peak_bytes} B exceeds its cap {self._finetune_cap_bytes} B"
            )
        want_pages = -(-peak_bytes // self._page_bytes)
        grow = want_pages - len(self._finetune_physical)
        if grow > len(self._free_physical):
            raise PhysicalMemoryUnavailable(
                f"finetune needs {grow} more pages, device has {len(self._free_physical)} free"
            )
        for _ in range(max(grow, 0)):
            self._finetune_physical.append(self._free_physical.pop())
        self._finetune_allocated_bytes = resident_bytes

    def release_finetune_cache(self) -> int:
        self._check_open()
        keep = -(-self._finetune_allocated_bytes // self._page_bytes)
        while len(self._finetune_physical) > keep:
            self._free_physical.append(self._finetune_physical.pop())
        self._free_physical.sort(reverse=True)
        return self.finetune_reserved_bytes()

    def physical_owners(self) -> dict[int, str]:
        """Owner of every physical page id: "kv:<slot>", "finetune" or "free".

        Raises `MemoryPoolError` when a page has two owners or none: the check behind the
        "no page owned twice" invariant.
        """
        owners: dict[int, str] = {}
        claims = [(phys, f"kv:{slot}") for slot, phys in self._slot_to_physical.items()]
        claims += [(phys, "finetune") for phys in self._finetune_physical]
        claims += [(phys, "free") for phys in self._free_physical]
        for phys, owner in claims:
            if phys in owners:
                raise MemoryPoolError(f"physical page {phys} owned by {owners[phys]} and {owner}")
            owners[phys] = owner
        if len(owners) != self._num_pages:
            raise MemoryPoolError(f"{self._num_pages - len(owners)} physical pages have no owner")
        return owners

    def close(self) -> None:
        self._slot_to_physical.clear()
        self._finetune_physical.clear()
        self._free_physical = list(range(self._num_pages - 1, -1, -1))
        self._storage = None
        self._closed = True
