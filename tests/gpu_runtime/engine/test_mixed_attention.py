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


def test_varlen_tiles_cover_every_query_token_once() -> None:
    from gpu_runtime.engine.attention.varlen import build_varlen_tiles, varlen_block_q

    assert varlen_block_q(4) == 16 and varlen_block_q(2) == 32 and varlen_block_q(128) == 1
    query_lens = [1, 0, 40, 16, 17, 1, 3]
    tiles = build_varlen_tiles(query_lens, 16)
    assert tiles.query_start.tolist() == [0, 1, 1, 41, 57, 74, 75, 78]
    assert tiles.tile_seq.tolist() == [0, 2, 2, 2, 3, 4, 4, 5, 6]
    assert tiles.tile_q.tolist() == [0, 0, 16, 32, 0, 0, 16, 0, 0]
    packed = tiles.packed()
    assert packed.dtype.name == "int32" and packed.shape == (len(query_lens) + 1 + 2 * 9,)
    covered: list[int] = []
    for seq, q0 in zip(tiles.tile_seq.tolist(), tiles.tile_q.tolist(), strict=True):
        begin = int(tiles.query_start[seq])
        covered.extend(range(begin + q0, begin + min(q0 + 16, query_lens[seq])))
    assert covered == list(range(sum(query_lens)))
    assert build_varlen_tiles([], 16).num_tiles == 0


def _varlen_case(
    block_size: int, seed: int
) -> tuple[PagedKVCache, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows: decode (ctx 9), chunk from scratch (37 of 37), padded with tokens (2 of 0), no
    tokens, chunk after a prefix (21 of 50), decode (ctx 1), decode (ctx 70)."""
    config = tiny_config("llama")  # 4 heads, 2 KV heads: 32 query tokens per tile
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(config, 160, block_size, torch.float32, torch.device("cpu"))
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen))
    query_lens = [1, 37, 2, 0, 21, 1, 1]
    seq_lens = [9, 37, 0, 0, 50, 1, 70]
    width = -(-80 // block_size)
    table = torch.randperm(160, generator=gen)[: 7 * width].view(7, width).int()
    blocks, offsets = [], []
    for row, (count, length) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(max(0, length - count), length):
            blocks.append(int(table[row, pos // block_size]))
            offsets.append(pos % block_size)
        if length == 0:  # padded tokens write into the padding block; nobody reads them
            blocks.extend([160] * count)
            offsets.extend([0] * count)
    metadata = AttentionMetadata(
        slot_blocks=torch.tensor(blocks),
        slot_offsets=torch.tensor(offsets),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    tokens = sum(query_lens)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    return cache, metadata, q, k, v


def test_varlen_reference_equals_the_per_sequence_loop() -> None:
    """The varlen path (tile map, positions after a prefix, paging, padded rows) against
    `TorchPagedAttention`, through `MixedPagedAttention(varlen_fn=...)` and into `out`."""
    from gpu_runtime.engine.attention.mixed import reference_varlen_fn

    for block_size in (4, 16):
        cache, metadata, q, k, v = _varlen_case(block_size, seed=block_size)
        reference = TorchPagedAttention(cache, metadata)(1, q, k, v)
        fn = reference_varlen_fn(block_size)
        mixed = MixedPagedAttention(cache, metadata, compute_dtype=torch.float32, varlen_fn=fn)
        assert mixed.varlen_fn is not None
        out = torch.full_like(q, float("nan"))
        assert mixed.attend(1, q, out) is out
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
        assert not out[38:40].any()  # the padded row's tokens
        # slots past a row's context may hold NaN: never read
        table = metadata.block_tables
        for row, length in enumerate(metadata.seq_lens_host or []):
            for pos in range(length, table.shape[1] * block_size):
                cache.storage[int(table[row, pos // block_size]), :, :, :, pos % block_size] = (
                    float("nan")
                )
        again = MixedPagedAttention(cache, metadata, compute_dtype=torch.float32, varlen_fn=fn)
        torch.testing.assert_close(again.attend(1, q), reference, rtol=1e-5, atol=1e-5)
        # the SDPA path writes into `out` as well
        sdpa = MixedPagedAttention(cache, metadata, compute_dtype=torch.float32)
        into = torch.empty_like(q)
        sdpa.attend(1, q, into)
        torch.testing.assert_close(into, reference, rtol=1e-5, atol=1e-5)


_INTERPRETED = """
import torch
from tests.gpu_runtime.engine.test_mixed_attention import _varlen_case
from gpu_runtime.engine.attention.torch_paged import TorchPagedAttention
from gpu_runtime.engine.attention.varlen import build_varlen_tiles, varlen_block_q
from gpu_runtime.engine.attention.triton_varlen import varlen_paged_attention

for block_size, block_n in ((4, 16), (16, 64), (16, 32)):
    cache, metadata, q, k, v = _varlen_case(block_size, seed=block_size + block_n)
    reference = TorchPagedAttention(cache, metadata)(1, q, k, v)
    tiles = build_varlen_tiles(metadata.query_lens_host, varlen_block_q(2))
    out = torch.full_like(q, float("nan"))
    varlen_paged_attention(
        q, cache.key_caches[1], cache.value_caches[1], metadata.block_tables, metadata.seq_lens,
        torch.from_numpy(tiles.packed()), tiles.num_tiles, block_size, out, block_n=block_n,
    )
    err = float((out - reference).abs().max())
    assert err < 1e-4, (block_size, block_n, err)
print("ok")
"""


def test_varlen_triton_kernel_under_the_interpreter() -> None:
    """The Triton kernel itself (fp32, Triton interpreter on CPU, in a subprocess: the
    interpreter is chosen when the kernel is defined). Needs triton, and numpy < 2.4 (the
    interpreter converts 1-element arrays to loop bounds)."""
    import importlib.util
    import os
    import subprocess
    import sys

    import numpy as np
    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        pytest.skip("the Triton interpreter needs numpy < 2.4 for loop bounds from loads")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
