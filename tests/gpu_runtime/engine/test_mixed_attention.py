"""Steps mixing decode rows with prefill chunks (CPU, fp32): `MixedPagedAttention` (decode rows
in one batched call, chunks via SDPA) equals the per-sequence reference. The engine using it is
checked against one request at a time in test_engine.py (staggered arrivals)."""

from __future__ import annotations

import torch

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.mixed import MixedPagedAttention
from gpu_runtime.engine.attention.torch_paged import TorchPagedAttention
from gpu_runtime.engine.kv_cache import PagedKVCache
from gpu_runtime.model.tiny import tiny_config


def test_mixed_attention_equals_the_per_sequence_loop() -> None:
    config = tiny_config("llama")  # 4 heads, 2 KV heads
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(config, 64, 4, torch.float32, torch.device("cpu"))
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen))
    # rows: decode (ctx 9), chunk from scratch (5 of 5), decode (ctx 1), padded, chunk with a
    # prefix (3 of 14), decode (ctx 22)
    query_lens = [1, 5, 1, 0, 3, 1]
    seq_lens = [9, 5, 1, 0, 14, 22]
    table = torch.randperm(63, generator=gen)[:48].view(6, 8).int()
    tokens = sum(query_lens)
    blocks, offsets = [], []
    for row, (count, length) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(length - count, length):
            blocks.append(int(table[row, pos // 4]))
            offsets.append(pos % 4)
    metadata = AttentionMetadata(
        slot_blocks=torch.tensor(blocks),
        slot_offsets=torch.tensor(offsets),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    mixed = MixedPagedAttention(cache, metadata, compute_dtype=torch.float32)
    assert mixed.num_decode == 3 and len(mixed.chunks) == 2 and not mixed.all_decode
    out = mixed(1, q, k, v)
    reference = TorchPagedAttention(cache, metadata)(1, q, k, v)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    # cache slots past a row's context may hold anything (NaN in fresh storage): never read
    for row, length in enumerate(seq_lens):
        for pos in range(length, table.shape[1] * 4):
            cache.storage[int(table[row, pos // 4]), :, :, :, pos % 4] = float("nan")
    again = MixedPagedAttention(cache, metadata, compute_dtype=torch.float32).attend(1, q)
    torch.testing.assert_close(again, reference, rtol=1e-5, atol=1e-5)
    # decode-only rows: one batched call without index copies
    only = AttentionMetadata(
        slot_blocks=metadata.slot_blocks[[0]],
        slot_offsets=metadata.slot_offsets[[0]],
        seq_lens=metadata.seq_lens[[0]],
        block_tables=table[[0]],
        query_lens_host=[1],
        seq_lens_host=[9],
    )
    single = MixedPagedAttention(cache, only, compute_dtype=torch.float32)
    assert single.all_decode
    torch.testing.assert_close(single.attend(1, q[[0]]), reference[[0]], rtol=1e-5, atol=1e-5)
