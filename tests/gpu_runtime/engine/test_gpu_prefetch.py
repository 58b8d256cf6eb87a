"""CUDA-only: the bulk L2 prefetch kernels compile to Hopper's bulk prefetch, refuse ranges the
instruction cannot take, and change no value a decode step computes."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine import SamplingParams
from gpu_runtime.engine.prefetch_plan import L2Prefetch
from tests.gpu_runtime.engine.test_gpu_decode_paths import _engine, _model, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("evict_last", [False, True])
def test_range_kernel_issues_bulk_prefetches(evict_last: bool) -> None:
    from gpu_runtime.engine import l2_prefetch

    weight = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    before = weight.clone()
    kernel = l2_prefetch._prefetch_range_kernel[(2,)](
        weight,
        weight.numel(),
        ELEM_BYTES=2,
        CHUNK_ELEMS=8192,
        LANES=l2_prefetch.LANES,
        EVICT_LAST=evict_last,
        num_warps=1,
    )
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.prefetch.L2.global" in ptx
    assert ("evict_last" in ptx) is evict_last
    l2_prefetch.prefetch_tensor(weight, L2Prefetch(targets=frozenset({"o"}), evict_last=evict_last))
    torch.cuda.synchronize()
    assert torch.equal(weight, before)


def test_misaligned_ranges_are_refused_before_launch() -> None:
    from gpu_runtime.engine.l2_prefetch import prefetch_tensor

    flat = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        prefetch_tensor(flat[1:], L2Prefetch())
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_tensor(flat.view(64, 64)[:, :32], L2Prefetch())
    torch.cuda.synchronize()  # nothing illegal was launched


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_prefetching_decode_graphs_give_the_same_tokens_and_logprobs(architecture: str) -> None:
    model = _model(architecture)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 40, 77, 3, 20)]
    greedy = SamplingParams(
        max_tokens=16, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
    )
    expected = _run(_engine(model), prompts, greedy)
    for targets in (("o",), ("kv",), ("o", "kv")):
        got = _run(_engine(model, decode_l2_prefetch=targets), prompts, greedy)
        assert got == expected, targets  # a hint: the same kernels compute the same bits
