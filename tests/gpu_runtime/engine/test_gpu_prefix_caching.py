"""CUDA-only: prefix caching on the CUDA paths (varlen chunk attention over cached blocks,
decode graphs, async scheduling) gives the tokens of the engine without it, within bf16
rounding (a prefix computed in other chunks rounds differently)."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine import Engine, SamplingParams
from tests.gpu_runtime.engine.test_gpu_decode_paths import _agreement, _engine
from tests.gpu_runtime.small_model import small_cuda_model

pytestmark = pytest.mark.gpu

_GREEDY = SamplingParams(
    max_tokens=12, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    prefix = torch.randint(1, 1000, (100,), generator=gen).tolist()  # 6 full blocks of 16
    return [prefix + torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (7, 30, 1, 19)]


def _staggered(engine: Engine, prompts: list[list[int]]) -> tuple[dict[str, tuple], list[int]]:
    """A request every other step: per request tokens, logprobs and finish reason (as
    `test_gpu_decode_paths._run`), and each request's `num_cached_tokens`."""
    out: dict[str, tuple[list[int], list[float], str | None]] = {}
    cached: dict[str, int] = {}
    ids: list[str] = []
    pending = list(prompts)
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            ids.append(engine.add_request(pending.pop(0), _GREEDY))
            out[ids[-1]] = ([], [], None)
        for o in engine.step():
            tokens, logprobs, _ = out[o.request_id]
            tokens += o.new_token_ids
            logprobs += [lp.logprob for lp in o.new_logprobs]
            out[o.request_id] = (tokens, logprobs, o.finish_reason)
            cached[o.request_id] = o.num_cached_tokens
        steps += 1
    return {f"r{i}": out[r] for i, r in enumerate(ids)}, [cached[r] for r in ids]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_cached_prefix_gives_the_uncached_tokens_within_bf16(asynchronous: bool) -> None:
    model = small_cuda_model("llama")
    prompts = _prompts()
    expected, none = _staggered(_engine(model, enable_prefix_caching=False), prompts)
    engine = _engine(model, enable_prefix_caching=True, async_scheduling=asynchronous)
    got, cached = _staggered(engine, prompts)
    assert none == [0, 0, 0, 0]
    assert cached == [0, 96, 96, 96]  # the prefix's 6 full blocks
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
    engine.step()
    assert engine.runner.states == {} and engine.block_manager.num_used_blocks == 0
