"""Paged KV-cache storage.

One tensor holds every layer's K and V, block-major:
`[num_blocks + 1, num_layers, 2, num_kv_heads, block_size, head_dim]`.
Block-major means a block id names one contiguous slab of memory for all layers, so a memory
pool that owns the storage can hand blocks back and forth (the block manager's usable set) and,
with a virtual-memory mapping, reclaim the tail of the tensor. The last block is the runner's
padding sink: writes of padded batch slots go there; it is never handed out.

The storage comes from an injectable factory `(shape, dtype, device) -> Tensor`, so the unified
memory pool can own it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_runtime.contract.model_config import ModelConfig

KVStorageFactory = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def default_kv_storage(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Plain allocation (uninitialised)."""
    return torch.empty(shape, dtype=dtype, device=device)


class PagedKVCache:
    """KV storage plus the per-layer views and the write/gather primitives."""

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        storage_factory: KVStorageFactory = default_kv_storage,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = model_config.num_hidden_layers
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        shape = (
            num_blocks + 1,
            self.num_layers,
            2,
            self.num_kv_heads,
            block_size,
            self.head_dim,
        )
        storage = storage_factory(shape, dtype, device)
        if tuple(storage.shape) != shape or storage.dtype != dtype:
            raise ValueError(
                f"KV storage factory returned {tuple(storage.shape)} {storage.dtype}, "
                f"expected {shape} {dtype}"
            )
        if storage.device.type != device.type:
            raise ValueError(f"KV storage on {storage.device}, expected {device}")
        if not storage.is_contiguous():
            raise ValueError("KV storage must be contiguous")
        self.storage = storage
        self.pad_block = num_blocks
        # Per-layer views [num_blocks + 1, num_kv_heads, block_size, head_dim].
        self.key_caches = [storage[:, layer, 0] for layer in range(self.num_layers)]
        self.value_caches = [storage[:, layer, 1] for layer in range(self.num_layers)]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers (K and V)."""
        return self.storage[0].numel() * self.storage.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer's K and V) `src -> dst` for each pair, in one
        gather and one scatter on the device (stream-ordered: after the steps queued before,
        before those queued after). Sources and destinations must be disjoint."""
        device = self.storage.device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
        self.storage.index_copy_(0, dst, self.storage.index_select(0, src))

    def write(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
    ) -> None:
        """Store key/value `[T, n_kv_heads, head_dim]` at (block, offset) pairs `[T]`."""
        self.key_caches[layer][slot_blocks, :, slot_offsets] = key.to(self.storage.dtype)
        self.value_caches[layer][slot_blocks, :, slot_offsets] = value.to(self.storage.dtype)

    def gather(
        self, layer: int, block_ids: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[length, n_kv_heads, head_dim]` of one sequence's first `length`
        tokens, given its block ids `[>= cdiv(length, block_size)]`."""
        num = -(-length // self.block_size)
        ids = block_ids[:num]
        keys = (
            self.key_caches[layer][ids]
            .transpose(1, 2)
            .reshape(-1, self.num_kv_heads, self.head_dim)
        )
        values = (
            self.value_caches[layer][ids]
            .transpose(1, 2)
            .reshape(-1, self.num_kv_heads, self.head_dim)
        )
        return keys[:length], values[:length]
