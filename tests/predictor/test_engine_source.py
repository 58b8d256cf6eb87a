"""The profiler stages decode iterations exactly as the engine's runner does (CPU, tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_runtime.model import ModelConfig, build_random_model
from predictor_models.engine_source import (
    BLOCK_SIZE,
    EngineDecode,
    EngineMixedStep,
    EngineStep,
)


def test_staged_iteration_runs_through_the_runners_decode_step() -> None:
    model = build_random_model(ModelConfig.preset("tiny"), seed=0)
    model.fuse_projections()
    source = EngineDecode(model, 8192, seed=0)
    runner = source.runner
    contexts = [5, 17, 33]
    step = source.capture(contexts, 0, None)
    assert isinstance(step, EngineStep)
    bucket, batch = step.bucket, len(contexts)
    assert bucket == 4  # the smallest graph bucket holding 3 sequences
    ints = runner.decode.buf_ints[:, :bucket].numpy()
    np.testing.assert_array_equal(ints[1, :batch], contexts)  # the new token's position
    np.testing.assert_array_equal(ints[3, :batch], np.array(contexts) % BLOCK_SIZE)
    assert ints[2, batch] == runner.kv_cache.pad_block  # padding writes to the pad block
    if len(ints) > 4:
        assert np.all(ints[4] == -1)  # LoRA slot: base model
    seq_lens = runner.decode.buf_seq_lens[:bucket].numpy()
    np.testing.assert_array_equal(seq_lens, [6, 18, 34, 0])
    table = runner.decode.buf_table[:batch].numpy()
    for i, pos in enumerate(contexts):  # the slot block is the table's block of the position
        assert ints[2, i] == table[i, pos // BLOCK_SIZE]
    blocks = [set(table[i, : pos // BLOCK_SIZE + 1].tolist()) for i, pos in enumerate(contexts)]
    assert not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2])  # no shared blocks
    runner.decode.stage_seq_lens_np[:bucket] = seq_lens  # torch attention reads host lengths
    with torch.no_grad():
        logits = runner.decode.decode_forward(bucket)
    assert logits.shape == (bucket, model.config.vocab_size)
    assert torch.all(torch.isfinite(logits[:batch]))
    step.replay()  # CPU: the graph's step, eagerly over the same buffers


def _causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention over flattened tokens ``[T, heads, D]`` of one sequence."""
    groups = q.shape[1] // k.shape[1]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    kt, vt = kt.repeat_interleave(groups, 0), vt.repeat_interleave(groups, 0)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return out.transpose(0, 1)


def test_mixed_step_runs_decode_and_a_prefill_chunk_through_the_general_path() -> None:
    model = build_random_model(ModelConfig.preset("tiny"), seed=0)
    model.fuse_projections()
    source = EngineDecode(model, 8192, seed=0)
    step = source.capture([9, 40], 24, None)
    assert isinstance(step, EngineMixedStep)
    assert step.order == [("decode0", 1), ("decode1", 1), ("prefill", 24)]
    replayed = step.replay()  # twice: the states are not advanced
    with torch.no_grad():
        logits, sampled = source.runner.general.logits(step.order, source.runner.states, model)
        prompt = torch.tensor(source.runner.states["prefill"].token_ids)
        hidden = model(prompt, torch.arange(24), _causal)
        expected = model.compute_logits(hidden[-1:])
    torch.testing.assert_close(replayed, logits, rtol=0, atol=0)  # execute's path, unsampled
    assert sampled == ["decode0", "decode1", "prefill"]
    assert torch.all(torch.isfinite(logits))
    torch.testing.assert_close(logits[2:], expected, rtol=1e-4, atol=1e-4)


def test_mixed_graph_option_sets_the_engine_flag_and_keeps_cpu_steps_eager() -> None:
    model = build_random_model(ModelConfig.preset("tiny"), seed=0)
    model.fuse_projections()
    source = EngineDecode(model, 8192, seed=0, mixed_graphs=True)
    assert source.runner.config.mixed_cuda_graphs
    assert source.runner.config.max_num_batched_tokens == 1024
    step = source.capture([9, 40], 24, None, partition=48)
    assert isinstance(step, EngineMixedStep) and step.partition == 48
    assert (
        source.runner.general.mixed_graphs is None
    )  # no fused kernels off CUDA: nothing to capture
    assert step.replay().shape == (3, model.config.vocab_size)


def test_chunks_after_a_prefix_attend_to_it_and_match_a_dense_forward() -> None:
    model = build_random_model(ModelConfig.preset("tiny"), seed=0)
    model.fuse_projections()
    source = EngineDecode(
        model,
        8192,
        seed=0,
        mixed_graphs=True,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        graph_batch_sizes=(1, 2, 4, 8),
        max_model_len=256,
    )
    assert source.config.mixed_graph_token_sizes() == (64,)
    assert tuple(source.runner.decode.buckets) == (1, 2, 4, 8)
    step = source.capture([9, 40], 20, None, chunks=[(30, 12), (0, 8)])
    assert isinstance(step, EngineMixedStep)
    assert step.order == [("decode0", 1), ("decode1", 1), ("prefill", 12), ("prefill1", 8)]
    state = source.runner.states["prefill"]
    assert state.num_computed_tokens == 30 and len(state.token_ids) == 42
    logits = step.replay()
    assert logits.shape == (4, model.config.vocab_size)
    # the first chunk's prefix K/V come from the cache (random values), so compare the second
    # chunk (from position 0) with a dense forward
    second = torch.tensor(source.runner.states["prefill1"].token_ids)
    with torch.no_grad():
        hidden = model(second, torch.arange(8), _causal)
        expected = model.compute_logits(hidden[-1:])
    torch.testing.assert_close(logits[3:], expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="do not add up"):
        source.capture([9], 20, None, chunks=[(0, 12)])
