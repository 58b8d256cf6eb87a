"""A step's tokens flattened in batch order, for the general (non-bucketed) path.

Every scheduled request contributes `count` consecutive tokens (a prefill chunk, or one decode
token); the host lists here become the attention metadata and the model's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from gpu_runtime.engine.attention.metadata import AttentionMetadata


class RowState(Protocol):
    """What the flattening reads of the runner's per-request state."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    row: int
    lora_slot: int


@dataclass
class FlatBatch:
    """Host lists of one step, tokens in `order`."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    """Block-table row of each request."""
    sample_index: list[int] = field(default_factory=list)
    """Token index of each request whose chunk ends its known tokens (it samples)."""
    sampled_ids: list[str] = field(default_factory=list)
    token_slots: list[int] = field(default_factory=list)
    """LoRA slot per token (filled only when asked)."""

    def metadata(self, table: torch.Tensor, device: torch.device) -> AttentionMetadata:
        """Attention metadata on `device`; `table` is the runner's host block table."""
        return AttentionMetadata(
            slot_blocks=torch.tensor(self.blocks, device=device),
            slot_offsets=torch.tensor(self.offsets, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=table[self.rows].to(device),
            query_lens_host=self.query_lens,
            seq_lens_host=self.seq_lens,
        )


def flatten_step(
    order: list[tuple[str, int]],
    states: Mapping[str, RowState],
    block_size: int,
    with_slots: bool = False,
) -> FlatBatch:
    """The step's `(request_id, count)` tokens flattened; `with_slots`: LoRA slot per token."""
    flat = FlatBatch()
    for rid, count in order:
        state = states[rid]
        if with_slots:
            flat.token_slots.extend([state.lora_slot] * count)
        start = state.num_computed_tokens
        end = start + count
        flat.tokens.extend(state.token_ids[start:end])
        span = range(start, end)
        flat.positions.extend(span)
        flat.blocks.extend(state.block_ids[p // block_size] for p in span)
        flat.offsets.extend(p % block_size for p in span)
        flat.query_lens.append(count)
        flat.seq_lens.append(end)
        flat.rows.append(state.row)
        if end == len(state.token_ids):
            flat.sample_index.append(len(flat.tokens) - 1)
            flat.sampled_ids.append(rid)
    return flat
