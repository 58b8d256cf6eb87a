"""Two GPUs (NCCL): the TP 2 engine with CUDA graphs (the all-reduces captured inside them,
every rank capturing together) and async scheduling gives the TP 1 engine's greedy tokens
within bf16 rounding (a sum over two ranks' partial products rounds differently)."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine import EngineConfig, SamplingParams
from gpu_runtime.engine.engine_group import ModelSource, start_engine_group
from tests.gpu_runtime.engine.test_gpu_decode_paths import (
    _ENGINE_CONFIG,
    _agreement,
    _async_prompts,
    _engine,
    _run,
)
from tests.gpu_runtime.small_model import small_config, small_cuda_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

_GREEDY = SamplingParams(
    max_tokens=16, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
)


@pytest.mark.parametrize("staggered", [False, True], ids=["queued", "staggered"])
def test_two_gpus_with_graphs_and_async_give_the_one_gpu_tokens(staggered: bool) -> None:
    prompts = _async_prompts()
    expected = _run(
        _engine(small_cuda_model("llama"), async_scheduling=True), prompts, _GREEDY, staggered
    )
    config = EngineConfig(**{**_ENGINE_CONFIG, "async_scheduling": True})  # type: ignore[arg-type]
    source = ModelSource(config=small_config("llama"), seed=4, dtype="bfloat16")
    with start_engine_group(source, config, 2, timeout_s=300) as group:
        engine = group.engine
        assert engine.capture_cuda_graphs() == [8, 4, 2, 1]  # on both ranks, together
        got = _run(engine, prompts, _GREEDY, staggered)
        assert engine.runner.num_overlapped_steps > 0
        engine.step()
        assert engine.runner.states == {}
    assert [p.exitcode for p in group.processes] == [0]
    assert _agreement(expected, got) >= 0.9
    for key, (tokens, logprobs, _) in expected.items():
        ours_tokens, ours_logprobs, _ = got[key]
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, ours_tokens, strict=False)) if a != b),
            min(len(tokens), len(ours_tokens)),
        )
        if same:
            diff = torch.tensor(logprobs[:same]) - torch.tensor(ours_logprobs[:same])
            assert float(diff.abs().max()) < 0.05, (key, diff)
