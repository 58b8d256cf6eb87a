"""The profiling stand-in computes real decode steps (CPU, tiny model)."""

from __future__ import annotations

import random

import torch

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.finetune.lora import build_training_model
from gpu_runtime.model import ModelConfig, build_random_model
from predictor_models.profile import sample_decode, sample_finetune
from predictor_models.standin import LoraQuantum, PaddedDecodeAttention, StandInDecode


class _Recording:
    """Dense causal attention that keeps each layer's K/V (for building a cache)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.kv[layer] = (k, v)
        groups = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        kt, vt = kt.repeat_interleave(groups, 1), vt.repeat_interleave(groups, 1)
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return out.transpose(1, 2)


def test_padded_decode_attention_matches_dense_forward() -> None:
    cfg = ModelConfig.preset("tiny")
    model = build_random_model(cfg, seed=1)
    lengths = [7, 4]  # tokens already cached per sequence
    ids = torch.randint(cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    rec = _Recording()
    with torch.no_grad():
        dense = model(ids, positions, rec)  # [2, 8, hidden]
    layers, kvh, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    k_cache = torch.randn(layers, 2, kvh, 9, d)  # garbage past each length must be masked
    v_cache = torch.randn(layers, 2, kvh, 9, d)
    for layer, (k, v) in rec.kv.items():
        for b, n in enumerate(lengths):
            k_cache[layer, b, :, :n] = k[b, :n].transpose(0, 1)
            v_cache[layer, b, :, :n] = v[b, :n].transpose(0, 1)
    attention = PaddedDecodeAttention(k_cache, v_cache, torch.tensor(lengths), prefill_tokens=0)
    step_ids = torch.stack([ids[0, 7], ids[1, 4]])
    with torch.no_grad():
        out = model(step_ids, torch.tensor(lengths), attention)  # [2, hidden]
    torch.testing.assert_close(out[0], dense[0, 7], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], dense[1, 4], rtol=1e-4, atol=1e-4)


def test_step_with_prefill_chunk_and_lora_quantum_run() -> None:
    cfg = ModelConfig.preset("tiny")
    model = build_random_model(cfg, seed=0)
    model.fuse_projections()
    step = StandInDecode(model, max_kv_tokens=64).build_step([5, 9, 3], prefill_tokens=4)
    with torch.no_grad():
        assert step().shape == (4,)  # 3 decode tokens + the chunk's last token
    quantum = LoraQuantum(build_training_model(model, LoraSpec(rank=4), seed=0), 64, 32)
    quantum.forward_only()
    quantum.prepare_backward()
    quantum.backward()
    assert all(p.grad is not None for n, p in quantum.tree.named_parameters() if ".lora_B" in n)


def test_samplers_respect_limits() -> None:
    rng = random.Random(3)
    for _ in range(200):
        contexts, prefill = sample_decode(rng, max_kv_tokens=20000)
        assert 1 <= len(contexts) <= 256 and len(contexts) * (max(contexts) + 1) <= 20000
        assert prefill in (0, 64, 256, 512)
        tokens, seq_len, rank = sample_finetune(rng)
        assert tokens % seq_len == 0 and tokens <= 4096 and rank in (8, 16, 64)
