"""`PagePool`: the ledger of the unified pool, over a `PageBackend`.

Every page of the pool has exactly one owner at any time:
- DECODE: a KV slot with physical memory mapped under it. Decode owns a prefix `[0, m)` of the
  KV range, so the usable KV blocks are the first `KVLayout.blocks_in_pages(m)` blocks, plus an
  optional pinned tail `[num_pages - t, num_pages)` that stays mapped for the pool's lifetime
  (the decode engine's padding block lives past its last real block).
- FINETUNE: part of the finetune budget; its physical memory is the finetune allocator's to take.
- FREE: physical memory nobody was given (released to the device, mappable at once).

`decode_pages + finetune_pages + free_pages == num_pages` always. The pool only moves pages;
when to move them is `MemoryManager`'s business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_runtime.memory.layout import MemoryPoolError

if TYPE_CHECKING:
    import torch

    from gpu_runtime.memory.backend import PageBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySplit:
    """One reading of the pool, for metrics and heartbeats (bytes)."""

    pool_bytes: int
    decode_bytes: int
    finetune_budget_bytes: int
    free_bytes: int
    finetune_reserved_bytes: int
    finetune_allocated_bytes: int


class PagePool:
    """Ledger of page owners over a backend; every transition checks its preconditions."""

    def __init__(self, backend: PageBackend, *, pinned_tail_pages: int = 0) -> None:
        """`pinned_tail_pages` (rounded up to the map unit) are mapped now and never unmapped."""
        if pinned_tail_pages < 0:
            raise MemoryPoolError(f"pinned_tail_pages must be >= 0, got {pinned_tail_pages}")
        unit = backend.map_unit_pages
        tail = -(-pinned_tail_pages // unit) * unit
        if tail >= backend.num_pages:
            raise MemoryPoolError(
                f"pinned tail of {tail} pages leaves nothing of {backend.num_pages} pages"
            )
        self._backend = backend
        self.before_flush: Callable[[], object] | None = None
        """Called right before a reclaim flushes the finetune allocator's cache: drop what a
        flush cannot return, e.g. the finetune side's CUDA graphs, whose private memory pool
        stays reserved while they exist (`LoraTrainer.release_cuda_graphs`)."""
        self.last_flush_s: tuple[float, float] | None = None
        """(`before_flush`, cache release) seconds of the last flush: what a flush costs."""
        self._decode_pages = 0
        self._finetune_pages = 0
        self._tail_pages = tail
        backend.set_finetune_cap(0)
        if tail and backend.map_range(backend.num_pages - tail, tail) != tail:
            raise MemoryPoolError(f"no physical memory for the pinned tail of {tail} pages")

    @property
    def backend(self) -> PageBackend:
        return self._backend

    @property
    def page_bytes(self) -> int:
        return self._backend.page_bytes

    @property
    def num_pages(self) -> int:
        return self._backend.num_pages

    @property
    def map_unit_pages(self) -> int:
        """Decode grows and shrinks in multiples of this many pages (one physical chunk)."""
        return self._backend.map_unit_pages

    @property
    def decode_pages(self) -> int:
        """All pages decode owns: the mapped prefix plus the pinned tail."""
        return self._decode_pages + self._tail_pages

    @property
    def kv_prefix_pages(self) -> int:
        """Mapped prefix `[0, kv_prefix_pages)` of the KV range: where usable blocks live."""
        return self._decode_pages

    @property
    def prefix_limit_pages(self) -> int:
        """Most pages the prefix can reach (the pinned tail starts there)."""
        return self.num_pages - self._tail_pages

    @property
    def pinned_tail_pages(self) -> int:
        return self._tail_pages

    @property
    def finetune_pages(self) -> int:
        """Pages in the finetune budget."""
        return self._finetune_pages

    @property
    def free_pages(self) -> int:
        """Pages owned by nobody."""
        return self.num_pages - self.decode_pages - self._finetune_pages

    @property
    def finetune_budget_bytes(self) -> int:
        return self._finetune_pages * self.page_bytes

    def kv_storage(self) -> torch.Tensor:
        """The whole KV byte range (uint8); only the mapped prefix may be touched."""
        return self._backend.kv_storage()

    def grow_decode(self, count: int) -> int:
        """FREE -> DECODE: map the next `count` KV slots. Returns how many got memory.

        Fewer than `count` means the device had no physical memory for the rest (the finetune
        allocator still caches it); those pages stay FREE.
        """
        if count < 0 or count > self.free_pages:
            raise MemoryPoolError(f"cannot map {count} pages: {self.free_pages} are free")
        if self._decode_pages + count > self.prefix_limit_pages:
            raise MemoryPoolError(
                f"cannot map {count} pages: prefix at {self._decode_pages} of "
                f"{self.prefix_limit_pages}"
            )
        self._check_unit(count)
        if count == 0:
            return 0
        mapped = self._backend.map_range(self._decode_pages, count)
        self._decode_pages += mapped
        return mapped

    def shrink_decode(self, count: int) -> None:
        """DECODE -> FREE: unmap the top `count` KV slots. The caller guarantees no KV block on
        them is in use (and that no in-flight kernel reads them)."""
        if count < 0 or count > self._decode_pages:
            raise MemoryPoolError(f"cannot unmap {count} pages: {self._decode_pages} are mapped")
        self._check_unit(count)
        if count == 0:
            return
        self._backend.unmap_range(self._decode_pages - count, count)
        self._decode_pages -= count

    def _check_unit(self, count: int) -> None:
        if count % self.map_unit_pages:
            raise MemoryPoolError(
                f"{count} pages is not a multiple of the map unit ({self.map_unit_pages} pages)"
            )

    def lend_to_finetune(self, count: int) -> None:
        """FREE -> FINETUNE: raise the finetune budget by `count` pages."""
        if count < 0 or count > self.free_pages:
            raise MemoryPoolError(f"cannot lend {count} pages: {self.free_pages} are free")
        if count == 0:
            return
        self._finetune_pages += count
        self._backend.set_finetune_cap(self.finetune_budget_bytes)

    def finetune_resident_pages(self) -> int:
        """Pages the finetune side's live tensors need (not reclaimable before they are freed)."""
        allocated = self._backend.finetune_allocated_bytes()
        return -(-allocated // self.page_bytes)

    def finetune_reclaimable_pages(self) -> int:
        """Budget pages that can come back now: the budget less the live finetune tensors."""
        return max(self._finetune_pages - self.finetune_resident_pages(), 0)

    def finetune_held_pages(self) -> int:
        """Pages the finetune allocator physically holds now: live tensors plus its cache."""
        backend = self._backend
        held = max(backend.finetune_reserved_bytes(), backend.finetune_allocated_bytes())
        return -(-held // self.page_bytes)

    def finetune_flush_free_pages(self) -> int:
        """Budget pages that can come back by a cap change alone, with no cache flush: the
        budget less what the finetune allocator holds (those pages are physically free)."""
        return max(self._finetune_pages - self.finetune_held_pages(), 0)

    def reclaim_from_finetune(self, count: int, *, allow_flush: bool = True) -> bool:
        """FINETUNE -> FREE: lower the budget by `count` pages; flush the finetune allocator's
        cache only if what it holds exceeds the new budget. Returns whether it flushed.

        The budget's pages are physically free exactly when the allocator holds no more than
        the budget, so a flush is needed only then (it is the costly part of a reclaim: on CUDA
        it waits for the device and frees every cached segment, which the next quantum must
        allocate again). Precondition: the finetune side is between quanta and its live tensors
        fit the new budget (`count <= finetune_reclaimable_pages()`); with `allow_flush=False`
        also `count <= finetune_flush_free_pages()` (a cap change only).
        """
        if count < 0 or count > self.finetune_reclaimable_pages():
            raise MemoryPoolError(
                f"cannot reclaim {count} pages: budget {self._finetune_pages} pages, "
                f"{self.finetune_resident_pages()} held by live finetune tensors"
            )
        if not allow_flush and count > self.finetune_flush_free_pages():
            raise MemoryPoolError(
                f"cannot reclaim {count} pages without a cache flush: budget "
                f"{self._finetune_pages} pages, the finetune allocator holds "
                f"{self.finetune_held_pages()}"
            )
        if count == 0:
            return False
        self._finetune_pages -= count
        self._backend.set_finetune_cap(self.finetune_budget_bytes)
        if self._backend.finetune_reserved_bytes() <= self.finetune_budget_bytes:
            return False
        start = time.perf_counter()
        if self.before_flush is not None:
            self.before_flush()
        released = time.perf_counter()
        reserved = self._backend.release_finetune_cache()
        self.last_flush_s = (released - start, time.perf_counter() - released)
        if reserved > self.finetune_budget_bytes:
            logger.warning(
                "finetune allocator still holds %d B after its cache flush, budget is %d B",
                reserved,
                self.finetune_budget_bytes,
            )
        return True

    def flush_finetune_cache(self) -> int:
        """Return the finetune allocator's free cache to the device without a budget change
        and without `before_flush`: after the finetune side dropped memory only a flush
        returns (a separately pooled CUDA-graph shape). On CUDA it waits for the device: call
        it between quanta. Returns the bytes the allocator still holds."""
        start = time.perf_counter()
        reserved = self._backend.release_finetune_cache()
        self.last_flush_s = (0.0, time.perf_counter() - start)
        return reserved

    def reset_baseline(self) -> None:
        """See `PageBackend.reset_baseline`: after decode warm-up, before finetuning starts."""
        self._backend.reset_baseline()

    def split(self) -> MemorySplit:
        page = self.page_bytes
        return MemorySplit(
            pool_bytes=self.num_pages * page,
            decode_bytes=self.decode_pages * page,
            finetune_budget_bytes=self._finetune_pages * page,
            free_bytes=self.free_pages * page,
            finetune_reserved_bytes=self._backend.finetune_reserved_bytes(),
            finetune_allocated_bytes=self._backend.finetune_allocated_bytes(),
        )

    def check(self) -> None:
        """Raise `MemoryPoolError` unless the ledger agrees with the backend's physical state."""
        if min(self._decode_pages, self._finetune_pages, self.free_pages) < 0:
            raise MemoryPoolError(
                f"negative page count: decode {self._decode_pages}, "
                f"finetune {self._finetune_pages}, free {self.free_pages}"
            )
        mapped = self._backend.mapped_slots()
        expected = frozenset(range(self._decode_pages)) | frozenset(
            range(self.prefix_limit_pages, self.num_pages)
        )
        if mapped != expected:
            raise MemoryPoolError(
                f"ledger says slots [0, {self._decode_pages}) and the {self._tail_pages}-page "
                f"tail are mapped, backend has {len(mapped)} mapped slots"
            )
        reserved = self._backend.finetune_reserved_bytes()
        if reserved > self.finetune_budget_bytes:
            raise MemoryPoolError(
                f"finetune holds {reserved} B, over its budget {self.finetune_budget_bytes} B"
            )

    def close(self) -> None:
        self._backend.close()
        self._decode_pages = 0
        self._finetune_pages = 0
