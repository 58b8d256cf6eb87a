"""The profiler stages decode iterations exactly as the engine's runner does (CPU, tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_runtime.model import ModelConfig, build_random_model
from predictor_models.engine_source import BLOCK_SIZE, EngineDecode, EngineSourceError


def test_staged_iteration_runs_through_the_runners_decode_step() -> None:
    model = build_random_model(ModelConfig.preset("tiny"), seed=0)
    model.fuse_projections()
    source = EngineDecode(model, 8192, seed=0)
    runner = source.runner
    contexts = [5, 17, 33]
    step = source.capture(contexts, 0, None)
    bucket, batch = step.bucket, len(contexts)
    assert bucket == 4  # the smallest graph bucket holding 3 sequences
    ints = runner._buf_ints[:, :bucket].numpy()
    np.testing.assert_array_equal(ints[1, :batch], contexts)  # the new token's position
    np.testing.assert_array_equal(ints[3, :batch], np.array(contexts) % BLOCK_SIZE)
    assert ints[2, batch] == runner.kv_cache.pad_block  # padding writes to the pad block
    if len(ints) > 4:
        assert np.all(ints[4] == -1)  # LoRA slot: base model
    seq_lens = runner._buf_seq_lens[:bucket].numpy()
    np.testing.assert_array_equal(seq_lens, [6, 18, 34, 0])
    table = runner._buf_table[:batch].numpy()
    for i, pos in enumerate(contexts):  # the slot block is the table's block of the position
        assert ints[2, i] == table[i, pos // BLOCK_SIZE]
    blocks = [set(table[i, : pos // BLOCK_SIZE + 1].tolist()) for i, pos in enumerate(contexts)]
    assert not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2])  # no shared blocks
    runner._stage_seq_lens_np[:bucket] = seq_lens  # torch attention reads host lengths
    with torch.no_grad():
        logits = runner.decode_forward(bucket)
    assert logits.shape == (bucket, model.config.vocab_size)
    assert torch.all(torch.isfinite(logits[:batch]))
    with pytest.raises(EngineSourceError, match="no decode graph"):
        step.replay()  # graphs exist on CUDA only
    with pytest.raises(ValueError, match="no prefill chunk"):
        source.capture(contexts, 64, None)
