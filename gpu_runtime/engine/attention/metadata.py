"""Per-step attention metadata, passed explicitly (never stored in module state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to.

    Tokens are flattened `[T]` in batch order; sequence i owns `query_lens[i]` consecutive
    tokens, which are the last ones of its `seq_lens[i]` context tokens.
    """

    slot_blocks: torch.Tensor
    """`[T]` int64 block id receiving each token's K/V."""
    slot_offsets: torch.Tensor
    """`[T]` int64 offset inside that block."""
    seq_lens: torch.Tensor
    """`[B]` int32 context length after this step (0 for padded slots)."""
    block_tables: torch.Tensor
    """`[B, max_blocks_per_seq]` int32 block ids per sequence."""
    query_lens_host: list[int] | None = None
    """Tokens per sequence this step (host copy; the torch backend loops over it)."""
    seq_lens_host: list[int] | None = None
    """Host copy of seq_lens (torch backend)."""
