"""CUDA-only checks: Triton kernels against torch references, the CUDA-graph decode path against
HF transformers (bf16). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.model import build_random_model
from gpu_runtime.model.rope import apply_rope
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.small_model import small_config, small_cuda_model

pytestmark = pytest.mark.gpu


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(("heads", "kv_heads", "splits"), [(32, 8, 1), (28, 4, 8), (8, 8, 4)])
@pytest.mark.parametrize("pdl", [False, True])
def test_paged_decode_kernel_matches_gather_reference(
    heads: int, kv_heads: int, splits: int, pdl: bool
) -> None:
    from gpu_runtime.engine.attention.triton_decode import paged_decode_attention

    torch.manual_seed(0)
    dev, dt, bs, dim = torch.device("cuda"), torch.bfloat16, 16, 128
    seq_lens = [1, 17, 0, 300, 1000, 64]
    width = 64
    blocks = 6 * width + 1
    cache = torch.randn(blocks, 2, kv_heads, bs, dim, device=dev, dtype=dt)
    key_cache, value_cache = cache[:, 0], cache[:, 1]
    table = torch.randperm(blocks - 1, device=dev)[: 6 * width].view(6, width).int()
    q = torch.randn(6, heads, dim, device=dev, dtype=dt)
    lens = torch.tensor(seq_lens, device=dev, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, key_cache, value_cache, table, lens, bs, splits, out=out, pdl=pdl)
    for i, length in enumerate(seq_lens):
        if length == 0:
            assert torch.all(out[i] == 0)
            continue
        ids = table[i, : -(-length // bs)].long()
        k = key_cache[ids].transpose(1, 2).reshape(-1, kv_heads, dim)[:length].double()
        v = value_cache[ids].transpose(1, 2).reshape(-1, kv_heads, dim)[:length].double()
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * dim**-0.5
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
        assert _rel_err(out[i], ref) < 1e-2, (i, length)


@pytest.mark.parametrize("pdl", [False, True])
def test_fused_ops_match_torch(pdl: bool) -> None:
    from gpu_runtime.engine.fused_ops import rms_norm, rope_and_cache_write, silu_and_mul
    from gpu_runtime.model.modules import RMSNorm

    torch.manual_seed(1)
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(5, 4096, device=dev, dtype=dt)
    r = torch.randn(5, 4096, device=dev, dtype=dt)
    norm = RMSNorm(4096, 1e-5, device=dev, dtype=dt)
    norm.weight.data.normal_(1.0, 0.1)
    out, res = rms_norm(x, norm.weight, 1e-5, r, pdl)
    assert torch.equal(res, x + r)
    assert _rel_err(out, norm(x + r)) < 1e-2
    out, same = rms_norm(x, norm.weight, 1e-5, pdl=pdl)
    assert same is x and _rel_err(out, norm(x)) < 1e-2
    gu = torch.randn(5, 2 * 1000, device=dev, dtype=dt)
    ref = torch.nn.functional.silu(gu[:, :1000]) * gu[:, 1000:]
    assert _rel_err(silu_and_mul(gu, pdl=pdl), ref) < 1e-2
    heads, kv, dim, bs = 8, 2, 128, 16
    model = build_random_model(
        tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv, head_dim=dim),
        seed=0,
        device=dev,
        dtype=dt,
    )
    qkv = torch.randn(5, (heads + 2 * kv) * dim, device=dev, dtype=dt)
    positions = torch.tensor([0, 3, 100, 7, 511], device=dev)
    cos, sin = model.rope_cos_sin(torch.arange(512, device=dev), dt)
    cache = torch.zeros(10, 2, kv, bs, dim, device=dev, dtype=dt)
    slot_blocks = torch.tensor([1, 2, 3, 4, 9], device=dev)
    slot_offsets = torch.tensor([0, 5, 15, 1, 2], device=dev)
    q = rope_and_cache_write(
        qkv,
        positions,
        cos[:, 0, : dim // 2].contiguous(),
        sin[:, 0, : dim // 2].contiguous(),
        cache[:, 0],
        cache[:, 1],
        slot_blocks,
        slot_offsets,
        heads,
        kv,
        dim,
        pdl=pdl,
    )
    c, s = model.rope_cos_sin(positions, dt)
    q_ref = apply_rope(qkv[:, : heads * dim].view(5, heads, dim), c, s)
    k_ref = apply_rope(qkv[:, heads * dim : (heads + kv) * dim].view(5, kv, dim), c, s)
    v_ref = qkv[:, (heads + kv) * dim :].view(5, kv, dim)
    assert _rel_err(q, q_ref) < 1e-2
    assert _rel_err(cache[slot_blocks, 0, :, slot_offsets], k_ref) < 1e-2
    assert torch.equal(cache[slot_blocks, 1, :, slot_offsets], v_ref)


@pytest.mark.parametrize(
    ("architecture", "budget", "blas", "mixed_graphs"),
    [
        ("llama", 512, None, False),
        ("qwen2", 512, None, False),
        ("llama", 48, None, False),
        ("llama", 512, "cublaslt", False),
        ("llama", 48, None, True),
        ("qwen2", 100, None, True),
    ],
)
def test_cuda_graph_engine_logprobs_match_hf_bf16(
    architecture: str, budget: int, blas: str | None, mixed_graphs: bool
) -> None:
    """Budget 48 / 100: the long prompts are prefilled in chunks beside the short one's decode
    rows (mixed steps: fused kernels with `MixedPagedAttention`; with `mixed_graphs` replayed
    from the piecewise graphs of their token bucket). `blas`: the GEMMs' library during capture
    and eager steps (restored afterwards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = torch.device("cuda")
    config = small_config(architecture)
    model = small_cuda_model(architecture)
    hf = (
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config.to_hf_config()), dtype=torch.bfloat16
        )
        .to(dev)
        .eval()
    )
    hf.load_state_dict(model.state_dict(), strict=False)
    engine = Engine(
        model,
        EngineConfig(
            num_kv_blocks=256,
            block_size=16,
            max_num_seqs=8,
            max_model_len=256,
            max_num_batched_tokens=budget,
            device="cuda",
            decode_blas_library=blas,
            mixed_cuda_graphs=mixed_graphs,
        ),
    )
    library = torch.backends.cuda.preferred_blas_library()
    assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
    assert torch.backends.cuda.preferred_blas_library() == library
    assert engine.runner.general.mixed_attention
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 40, 77)]
    params = SamplingParams(
        max_tokens=12, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
    )
    ids = [engine.add_request(p, params) for p in prompts]
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    graph_steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.new_logprobs)
        graph_steps += int(engine.runner.decode.graphs is not None)
    assert (engine.runner.general.num_mixed_graph_steps > 0) == mixed_graphs
    agree = total = 0
    for rid, prompt in zip(ids, prompts, strict=True):
        full = torch.tensor([prompt + tokens[rid]], device=dev)
        with torch.no_grad():
            ref = hf(full).logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
        ours = torch.tensor(logprobs[rid], device=dev)
        theirs = ref.gather(-1, torch.tensor(tokens[rid], device=dev)[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=0.1), (ours, theirs)
        agree += int((ref.argmax(-1).cpu() == torch.tensor(tokens[rid])).sum())
        total += len(tokens[rid])
    assert agree >= 0.9 * total


def test_fused_sampling_kernel_distribution_greedy_and_seeds() -> None:
    from gpu_runtime.engine.sampler import Sampler, SamplingBatch
    from gpu_runtime.engine.sampling_kernels import gumbel_argmax

    dev = torch.device("cuda")
    torch.manual_seed(0)
    # greedy rows: exactly torch.argmax (ties: first index), vocab not a block multiple
    logits = torch.randn(6, 130_000, device=dev).to(torch.bfloat16)
    logits[2, 5] = logits[2, 70_000] = 100.0
    zeros = torch.zeros(6, device=dev)
    seeds = torch.arange(6, device=dev)
    assert torch.equal(gumbel_argmax(logits, zeros, seeds), logits.argmax(-1))
    # the vocabulary split does not change a token: every part count gives the same rows
    inv_temp = torch.full((6,), 1 / 0.8, device=dev)
    inv_temp[4] = 0.0
    split = [gumbel_argmax(logits, inv_temp, seeds, parts=p) for p in (1, 3, 64, 128)]
    assert all(torch.equal(s, split[0]) for s in split[1:]), split
    assert int(split[0][4]) == int(logits[4].argmax())
    # sampled rows: frequencies match softmax(logits / T)
    small = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2], device=dev)
    rows = 40_000
    temperature = 0.7
    tokens = gumbel_argmax(
        small.expand(rows, -1),
        torch.full((rows,), 1 / temperature, device=dev),
        torch.arange(rows, device=dev) * 7919 + 13,
    )
    freq = torch.bincount(tokens, minlength=8).float() / rows
    expected = (small / temperature).softmax(-1)
    assert (freq - expected).abs().max() < 0.01, (freq, expected)
    # the sampler: seeded rows do not depend on the batch; fused kernel used
    sampler = Sampler(dev, seed=0, fused_min_rows=1)
    seeded = SamplingParams(temperature=1.0, seed=42)
    batch_logits = torch.randn(3, 1000, device=dev)
    batch_logits[2] = batch_logits[1]
    out = sampler.sample(
        batch_logits, SamplingBatch([SamplingParams(temperature=0.9), seeded, seeded], [0, 3, 3])
    )
    alone = Sampler(dev, seed=9, fused_min_rows=1).sample(
        batch_logits[1:2], SamplingBatch([seeded], [3])
    )
    assert int(out.token_ids[1]) == int(out.token_ids[2]) == int(alone.token_ids[0])
    assert sampler.num_fused_samples == 1
