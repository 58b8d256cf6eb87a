"""Page and KV-block geometry of the unified pool, and the pool's error types.

The pool hands out physical memory in pages (2 MiB on CUDA, the driver's mapping granularity).
The decode engine stores its KV cache block-major in one byte range: block `b` occupies bytes
`[b * block_bytes, (b + 1) * block_bytes)` of that range, and decode owns a mapped prefix of it.
A block is usable when every page it touches is mapped, so with `m` mapped pages the first
`(m * page_bytes) // block_bytes` blocks are usable. A Llama-3-8B block of 16 tokens over all
32 layers (K and V, 8 KV heads of 128 bf16 values) is exactly one 2 MiB page; other shapes
straddle pages and waste nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30
CUDA_PAGE_BYTES = 2 * MIB
"""Granularity of `cuMemCreate`/`cuMemMap` on NVIDIA GPUs (queried again at run time)."""


class MemoryPoolError(RuntimeError):
    """Misuse of the pool: a transition that would break its accounting. Always a bug."""


class PhysicalMemoryUnavailable(MemoryPoolError):
    """The device had no physical memory for a map (e.g. the finetune side still caches it).

    The pool leaves its accounting unchanged for the pages that could not be mapped.
    """


class FinetuneBudgetExceeded(MemoryPoolError):
    """The finetune side used (or reported) more bytes than its budget allowed."""


def kv_block_bytes(
    *,
    block_tokens: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
) -> int:
    """Bytes of one KV block: K and V of `block_tokens` tokens in every layer."""
    for name, value in (
        ("block_tokens", block_tokens),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return 2 * block_tokens * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVLayout:
    """How KV blocks sit on pages: block `b` covers bytes `[b*block_bytes, (b+1)*block_bytes)`."""

    page_bytes: int
    """Bytes of one pool page (the map/unmap unit)."""
    block_bytes: int
    """Bytes of one KV block across all layers (see `kv_block_bytes`)."""

    def __post_init__(self) -> None:
        if self.page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {self.page_bytes}")
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {self.block_bytes}")

    def blocks_in_pages(self, pages: int) -> int:
        """Blocks fully inside the first `pages` pages."""
        if pages < 0:
            raise ValueError(f"pages must be >= 0, got {pages}")
        return (pages * self.page_bytes) // self.block_bytes

    def pages_for_blocks(self, blocks: int) -> int:
        """Fewest leading pages that hold the first `blocks` blocks."""
        if blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {blocks}")
        return -(-(blocks * self.block_bytes) // self.page_bytes)

    def pages_for_bytes(self, nbytes: int) -> int:
        """Pages needed to hold `nbytes` (rounded up)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return -(-nbytes // self.page_bytes)
