"""Varlen paged attention for a whole step: the host tile map and a torch reference.

A step with prefill chunks attends in one launch per layer (`triton_varlen.py`): every query
token of the step (decode rows, chunks, chunks after a cached prefix) is covered by a tile of
`block_q` consecutive query tokens of one sequence times the `group` query heads sharing a KV
head, reading K/V straight from the paged cache through the block table. The tile map is built
once per step on the host (`VarlenTiles`) and reused by every layer; shapes never enter the
kernel's compiled signature (only the head geometry and block sizes do), so steps of any mix of
lengths reuse one compiled kernel.

Query token `i` of a sequence with `n` query tokens and context length `L` (its K/V written)
sits at position `L - n + i` and attends to keys `0 .. L - n + i`. Sequences with context
length 0 (padded slots) produce zeros.

`varlen_attention_reference` computes the same result tile by tile in plain torch (the tests'
check of the tile map, the causal positions and the paging; the kernel itself is checked
against it under the Triton interpreter and on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TILE_ROWS = 64
"""Rows of a tile (query tokens x heads of one KV group), the tensor-core M of the kernel."""


def varlen_block_q(group: int, tile_rows: int = TILE_ROWS) -> int:
    """Query tokens per tile: `tile_rows // group` (at least 1)."""
    return max(1, tile_rows // group)


@dataclass
class VarlenTiles:
    """One step's tile map (host arrays, int32).

    `query_start[b]`: first flattened token of sequence b (`len == B + 1`, the last entry the
    step's token count); tile t covers query tokens `tile_q[t] .. tile_q[t] + block_q - 1` of
    sequence `tile_seq[t]` (clipped to the sequence's query tokens)."""

    query_start: np.ndarray
    tile_seq: np.ndarray
    tile_q: np.ndarray
    block_q: int

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])

    def packed(self) -> np.ndarray:
        """`[query_start | tile_seq | tile_q]` in one int32 array (one copy to the device)."""
        return np.concatenate([self.query_start, self.tile_seq, self.tile_q])


def build_varlen_tiles(query_lens: list[int], block_q: int) -> VarlenTiles:
    """Tile map of a step whose sequence b has `query_lens[b]` query tokens (0: no tile)."""
    counts = np.asarray(query_lens, dtype=np.int32)
    start = np.zeros(counts.shape[0] + 1, dtype=np.int32)
    np.cumsum(counts, out=start[1:])
    per_seq = (counts + (block_q - 1)) // block_q
    tile_seq = np.repeat(np.arange(counts.shape[0], dtype=np.int32), per_seq)
    first_tile = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    tile_q = ((np.arange(tile_seq.shape[0]) - first_tile) * block_q).astype(np.int32)
    return VarlenTiles(start, tile_seq, tile_q, block_q)


def varlen_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    tiles: VarlenTiles,
    block_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the kernel computes, tile by tile and KV group by KV group (fp32 math).

    q `[T, H, D]`; key/value_cache `[num_blocks, Hkv, block_size, D]`; block_tables `[B, W]`;
    seq_lens `[B]`; writes and returns out `[T, H, D]`. Tokens no tile covers are left as
    they are."""
    if out is None:
        out = torch.zeros_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5
    lens = seq_lens.tolist()
    for seq, q0 in zip(tiles.tile_seq.tolist(), tiles.tile_q.tolist(), strict=True):
        begin, end = int(tiles.query_start[seq]), int(tiles.query_start[seq + 1])
        count, length = end - begin, int(lens[seq])
        rows = range(q0, min(q0 + tiles.block_q, count))
        tokens = [begin + i for i in rows]
        if length <= 0:
            out[tokens] = 0
            continue
        prefix = length - count
        kv_end = min(length, prefix + q0 + tiles.block_q)
        keys_at = torch.arange(kv_end, device=key_cache.device)
        blocks = block_tables[seq].to(key_cache.device).long()[keys_at // block_size]
        offsets = keys_at % block_size
        positions = torch.tensor([prefix + i for i in rows], device=key_cache.device)
        allowed = keys_at[None, :] <= positions[:, None]  # [n, kv_end]
        for kv_head in range(num_kv_heads):
            keys = key_cache[blocks, kv_head, offsets].float()  # [kv_end, D]
            values = value_cache[blocks, kv_head, offsets].float()
            heads = slice(kv_head * group, (kv_head + 1) * group)
            qi = q[tokens, heads].float()  # [n, G, D]
            scores = torch.einsum("ngd,kd->ngk", qi, keys) * scale
            scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            out[tokens, heads] = torch.einsum("ngk,kd->ngd", weights, values).to(out.dtype)
    return out
