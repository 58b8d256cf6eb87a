"""Paged attention for steps that mix decode rows with prefill chunks.

`TorchPagedAttention` loops over every sequence in Python per layer: in a step with a prefill
chunk beside 32 decode rows that is ~33 gathers and SDPA calls per layer, hundreds of ms per
step on a GPU. Here the rows with one query token (decode rows, and a chunk's single last token)
attend in one batched call per layer (`decode_fn`: the Triton paged-decode kernel on CUDA,
`torch_paged_decode` elsewhere); only sequences with several query tokens (prefill chunks, few
per step) go through gather + SDPA. With a `varlen_fn` (on CUDA: the Triton kernel of
`triton_varlen.py`), a step with chunks instead attends in one launch per layer for all its
tokens, reading K/V from the paged cache (`varlen.py`); per chunk and layer, the SDPA path
launches a dozen kernels from Python. `attend` assumes this step's K/V are already in the cache
(the fused RoPE kernel writes them); `__call__` writes them first (an `AttentionFn`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.varlen import (
    VarlenTiles,
    build_varlen_tiles,
    varlen_attention_reference,
    varlen_block_q,
)
from gpu_runtime.engine.kv_cache import PagedKVCache

DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
"""`(q [B, H, D], key_cache, value_cache, block_tables [B, W] int32, seq_lens [B] int32) ->
[B, H, D]`: one query per sequence over its paged context (K/V already written)."""

VarlenFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        VarlenTiles,
        torch.Tensor,
        torch.Tensor,
    ],
    torch.Tensor,
]
"""`(q [T, H, D], key_cache, value_cache, block_tables [B, W] int32, seq_lens [B] int32, tiles,
tiles on the device (`tiles.packed()`, int32), out [T, H, D]) -> out`: every query token of a
step over its paged context in one call (see `varlen.py`)."""


def reference_varlen_fn(block_size: int) -> VarlenFn:
    """A `VarlenFn` in plain torch (`varlen_attention_reference`; CPU tests)."""

    def attend(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        tiles: VarlenTiles,
        tiles_device: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        del tiles_device
        return varlen_attention_reference(
            q, key_cache, value_cache, block_tables, seq_lens, tiles, block_size, out
        )

    return attend


def torch_paged_decode(
    block_size: int, compute_dtype: torch.dtype | None = None
) -> Callable[..., torch.Tensor]:
    """A `DecodeFn` in plain torch: gathers every row's blocks (padded to the longest row) and
    runs one masked SDPA for the whole batch."""

    def decode(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
    ) -> torch.Tensor:
        rows, num_kv_heads = q.shape[0], key_cache.shape[1]
        num_blocks = -(-max_len // block_size)
        blocks = block_tables[:, :num_blocks].long()  # [B, nb]
        length = num_blocks * block_size
        dtype = compute_dtype or q.dtype

        mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]

        def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, nb*bs, D]
            picked = cache[blocks]  # [B, nb, Hkv, bs, D]
            picked = picked.permute(0, 2, 1, 3, 4).reshape(rows, num_kv_heads, length, -1)
            # slots past a row's length may hold NaN (fresh storage): a zero weight times NaN
            # is NaN, so they are zeroed, not only masked
            return torch.where(mask[:, None, :, None], picked, 0).to(dtype)

        out = F.scaled_dot_product_attention(
            q[:, :, None, :].to(dtype),
            gather(key_cache),
            gather(value_cache),
            attn_mask=mask[:, None, None, :],
            enable_gqa=True,
        )  # [B, H, 1, D]
        return out[:, :, 0].to(q.dtype)

    return decode


class MixedPagedAttention:
    """`AttentionFn` (and `attend`) for any step; see the module docstring.

    decode_fn: for the single-query rows; `None` uses `torch_paged_decode`.
    compute_dtype: dtype of the torch math (fp32 on CPU; None keeps the input dtype).
    varlen_fn: when given, a step that is not decode-only attends through it, all tokens at
    once (decode_fn then serves decode-only steps only).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        metadata: AttentionMetadata,
        decode_fn: DecodeFn | None = None,
        compute_dtype: torch.dtype | None = None,
        varlen_fn: VarlenFn | None = None,
    ) -> None:
        query_lens, seq_lens = metadata.query_lens_host, metadata.seq_lens_host
        if query_lens is None or seq_lens is None:
            raise ValueError("MixedPagedAttention needs host query_lens and seq_lens")
        self.cache = cache
        self.metadata = metadata
        self.compute_dtype = compute_dtype
        dev = metadata.seq_lens.device
        decode_rows: list[int] = []
        decode_tokens: list[int] = []
        self.chunks: list[tuple[int, int, int, int]] = []  # (row, first token, count, length)
        self.empty_tokens: list[tuple[int, int]] = []  # padded rows: (first token, count)
        start = 0
        for row, (count, length) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if count == 0:
                continue
            if length == 0:
                self.empty_tokens.append((start, count))
            elif count == 1:
                decode_rows.append(row)
                decode_tokens.append(start)
            else:
                self.chunks.append((row, start, count, length))
            start += count
        self.num_tokens = start
        self.all_decode = len(decode_rows) == len(query_lens) == start
        self.max_decode_len = max((seq_lens[r] for r in decode_rows), default=0)
        self.decode_fn = decode_fn
        self.varlen_fn = None if self.all_decode else varlen_fn
        self._tiles: tuple[VarlenTiles, torch.Tensor] | None = None
        self.num_decode = len(decode_rows)
        self._chunk_slots: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        if self.varlen_fn is not None:
            return  # tiles built at the first `attend` (they need the query heads)
        if self.all_decode:
            self.decode_tables = metadata.block_tables
            self.decode_lens = metadata.seq_lens
        elif decode_rows:
            rows = torch.tensor(decode_rows, device=dev)
            self.decode_token_index = torch.tensor(decode_tokens, device=dev)
            self.decode_tables = metadata.block_tables.index_select(0, rows)
            self.decode_lens = metadata.seq_lens.index_select(0, rows)
        # per chunk, once per step (every layer reuses them): the cache slot (block, offset)
        # of each context token and, for a chunk after a prefix, its causal mask
        block_size = cache.block_size
        for row, _, count, length in self.chunks:
            positions = torch.arange(length, device=dev)
            blocks = metadata.block_tables[row].long().index_select(0, positions // block_size)
            mask = None
            if count != length:
                offsets = torch.arange(count, device=dev)[:, None] + (length - count)
                mask = positions[None, :] <= offsets  # [n, L]
            self._chunk_slots.append((blocks, positions % block_size, mask))

    def _decode(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        key_cache = self.cache.key_caches[layer_idx]
        value_cache = self.cache.value_caches[layer_idx]
        if self.decode_fn is not None:
            return self.decode_fn(q, key_cache, value_cache, self.decode_tables, self.decode_lens)
        decode = torch_paged_decode(self.cache.block_size, self.compute_dtype)
        return decode(
            q, key_cache, value_cache, self.decode_tables, self.decode_lens, self.max_decode_len
        )

    def _varlen(self, layer_idx: int, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        assert self.varlen_fn is not None
        if self._tiles is None:
            meta = self.metadata
            assert meta.query_lens_host is not None
            group = q.shape[1] // self.cache.num_kv_heads
            tiles = build_varlen_tiles(meta.query_lens_host, varlen_block_q(group))
            packed = torch.from_numpy(tiles.packed())
            if meta.seq_lens.device.type == "cuda":
                packed = packed.pin_memory().to(meta.seq_lens.device, non_blocking=True)
            self._tiles = (tiles, packed)
        tiles, packed = self._tiles
        return self.varlen_fn(
            q,
            self.cache.key_caches[layer_idx],
            self.cache.value_caches[layer_idx],
            self.metadata.block_tables,
            self.metadata.seq_lens,
            tiles,
            packed,
            torch.empty_like(q) if out is None else out,
        )

    def attend(
        self, layer_idx: int, q: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q `[T, H, D]` (this step's K/V already in the cache) -> `[T, H, D]`, written into
        `out` when given (returned either way)."""
        if self.varlen_fn is not None:
            return self._varlen(layer_idx, q, out)
        result = self._attend(layer_idx, q)
        if out is None:
            return result
        out.copy_(result)
        return out

    def _attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        if self.all_decode:
            return self._decode(layer_idx, q.contiguous())
        out = torch.empty_like(q)
        if self.num_decode:
            rows = self._decode(layer_idx, q.index_select(0, self.decode_token_index))
            out.index_copy_(0, self.decode_token_index, rows)
        for start, count in self.empty_tokens:
            out[start : start + count] = 0
        dtype = self.compute_dtype or q.dtype
        key_cache = self.cache.key_caches[layer_idx]  # [blocks, Hkv, block_size, D]
        value_cache = self.cache.value_caches[layer_idx]
        for (_, start, count, _), (blocks, offsets, mask) in zip(
            self.chunks, self._chunk_slots, strict=True
        ):
            keys = key_cache[blocks, :, offsets]  # [L, Hkv, D]
            values = value_cache[blocks, :, offsets]
            # 3-D inputs: SDPA's math path, whatever the chunk's shape. 4-D inputs reach the
            # fused kernels but slow steps whose chunks vary in length
            # (docs/decisions/0001-attention-backend.md).
            qi = q[start : start + count].transpose(0, 1).to(dtype)  # [H, n, D]
            ki = keys.transpose(0, 1).to(dtype)  # [Hkv, L, D]
            vi = values.transpose(0, 1).to(dtype)
            if mask is None:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            out[start : start + count] = oi.transpose(0, 1).to(q.dtype)
        return out

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        meta = self.metadata
        self.cache.write(layer_idx, k, v, meta.slot_blocks, meta.slot_offsets)
        return self.attend(layer_idx, q)
