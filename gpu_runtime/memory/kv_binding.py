"""`KVPoolBinding`: the decode engine's KV storage and block manager, fed by the unified pool.

The engine builds its `PagedKVCache` with `binding.storage_factory` (a view of the pool's KV range
shaped `[capacity_blocks + 1, ...]`, the last block being the engine's padding sink, which lives
in the pool's pinned tail) and its `BlockManager(num_blocks=binding.initial_blocks,
block_size=..., capacity=binding.capacity_blocks)`, then calls `binding.attach(block_manager)`.
Each iteration:
1. after the step's sync point, before scheduling: `grant = binding.before_step(
   next_step_blocks=..., waiting_blocks=...)`; when `grant.short_blocks > 0` the scheduler will
   find too few free blocks and preempt, which the pool allows only when finetuning holds
   nothing reclaimable;
2. schedule and launch the step;
3. while the GPU runs it: `binding.maintain(waiting_blocks=...)`.
Blocks enter and leave the block manager only through `grow`/`remove` on the top of the id range,
so usable ids are always `[0, manager.usable_blocks)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gpu_runtime.memory.layout import MemoryPoolError
from gpu_runtime.memory.manager import DecodeDemand, DecodeGrant, MemoryManager

if TYPE_CHECKING:
    import torch


class BlockManagerLike(Protocol):
    """What the binding needs of the decode engine's block manager (plain integers)."""

    @property
    def capacity(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def num_usable_blocks(self) -> int: ...

    def free_block_ids(self) -> list[int]: ...

    def grow(self, block_ids: list[int]) -> None: ...

    def remove(self, block_ids: list[int]) -> None: ...


class KVPoolBinding:
    """Keeps a block manager's usable ids equal to the blocks the pool has mapped."""

    def __init__(self, manager: MemoryManager) -> None:
        pool = manager.pool
        block_bytes = manager.layout.block_bytes
        limit_bytes = pool.prefix_limit_pages * pool.page_bytes
        # Real blocks end at or after the prefix limit, so the padding block starts in the tail.
        self.capacity_blocks = math.ceil(limit_bytes / block_bytes)
        pad_end = (self.capacity_blocks + 1) * block_bytes
        if pad_end > pool.num_pages * pool.page_bytes:
            raise MemoryPoolError(
                f"the padding block ends at byte {pad_end}, past the pool's "
                f"{pool.num_pages * pool.page_bytes} B: pin a tail of at least "
                f"{math.ceil(2 * block_bytes / pool.page_bytes)} pages"
            )
        self.manager = manager
        self._block_manager: BlockManagerLike | None = None
        self._usable = manager.usable_blocks

    @property
    def initial_blocks(self) -> int:
        """Usable blocks to build the block manager with (`num_blocks`)."""
        return self._usable

    def storage_factory(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The pool's KV range as the engine's `[capacity_blocks + 1, ...]` storage tensor."""
        import torch

        block_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        if shape[0] != self.capacity_blocks + 1:
            raise MemoryPoolError(
                f"KV storage of {shape[0]} blocks asked, the pool holds "
                f"{self.capacity_blocks} + 1 padding block"
            )
        if block_bytes != self.manager.layout.block_bytes:
            raise MemoryPoolError(
                f"a KV block of shape {shape[1:]} {dtype} is {block_bytes} B, the pool's layout "
                f"says {self.manager.layout.block_bytes} B"
            )
        storage = self.manager.pool.kv_storage()
        if storage.device.type != torch.device(device).type:
            raise MemoryPoolError(f"pool storage is on {storage.device}, engine wants {device}")
        return storage[: shape[0] * block_bytes].view(dtype).view(shape)

    def attach(self, block_manager: BlockManagerLike) -> None:
        """Bind the engine's block manager (built with `initial_blocks` and `capacity_blocks`)."""
        if block_manager.capacity != self.capacity_blocks:
            raise MemoryPoolError(
                f"block manager capacity {block_manager.capacity} != pool capacity "
                f"{self.capacity_blocks}"
            )
        if block_manager.num_usable_blocks != self._usable:
            raise MemoryPoolError(
                f"block manager has {block_manager.num_usable_blocks} usable blocks, the pool "
                f"mapped {self._usable}"
            )
        self._block_manager = block_manager

    def before_step(
        self,
        *,
        next_step_blocks: int,
        waiting_blocks: int = 0,
        finetune_busy: bool = False,
        wait_for_finetune: Callable[[], object] | None = None,
        promised_bytes: int | None = None,
    ) -> DecodeGrant:
        """Critical path: make the next step's blocks usable (see `MemoryManager.before_step`)."""
        bm = self._bound()
        grant = self.manager.before_step(
            DecodeDemand(
                used_blocks=bm.num_used_blocks,
                next_step_blocks=next_step_blocks,
                waiting_blocks=waiting_blocks,
            ),
            finetune_busy=finetune_busy,
            wait_for_finetune=wait_for_finetune,
            promised_bytes=promised_bytes,
        )
        self._sync()
        return grant

    def maintain(
        self,
        *,
        waiting_blocks: int = 0,
        finetune_busy: bool = False,
        promised_bytes: int | None = None,
    ) -> None:
        """Off the critical path (see `MemoryManager.maintain`)."""
        bm = self._bound()
        demand = DecodeDemand(used_blocks=bm.num_used_blocks, waiting_blocks=waiting_blocks)
        self.manager.maintain(
            demand,
            top_used_block=self._top_used_block,
            finetune_busy=finetune_busy,
            promised_bytes=promised_bytes,
        )
        self._sync()

    def refill(self, *, waiting_blocks: int = 0) -> int:
        """Between finetune quanta, before the step (see `MemoryManager.refill_reserve`)."""
        bm = self._bound()
        demand = DecodeDemand(used_blocks=bm.num_used_blocks, waiting_blocks=waiting_blocks)
        got = self.manager.refill_reserve(demand)
        self._sync()
        return got

    def _top_used_block(self) -> int:
        """One past the highest used block id: scan down from the top over free ids."""
        free = set(self._bound().free_block_ids())
        top = self._usable
        while top > 0 and top - 1 in free:
            top -= 1
        return top

    def _sync(self) -> None:
        bm = self._bound()
        usable = self.manager.usable_blocks
        if usable > self._usable:
            bm.grow(list(range(self._usable, usable)))
        elif usable < self._usable:
            bm.remove(list(range(usable, self._usable)))
        self._usable = usable

    def _bound(self) -> BlockManagerLike:
        if self._block_manager is None:
            raise MemoryPoolError("attach the engine's block manager first")
        return self._block_manager
