"""The parameter-holding modules of a Llama-family decoder layer, with HF parameter names.

They hold weights and how the weights are laid out (separate `nn.Linear`s, or row views of one
fused tensor set by `CausalLM.fuse_projections`); the computation of a layer is written once,
in `gpu_runtime.model.decoder`, over a `DecoderOps` that chooses the kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.parallel import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (HF order)."""

    def __init__(
        self,
        size: int,
        eps: float,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    """Self-attention projections (Qwen2: q/k/v biases; Llama: `attention_bias` on all four).

    `config` has this rank's shapes (`ShardShape.local_config`); `o_bias` is False on the
    tensor-parallel ranks that do not hold the o projection's bias (it is added once).
    """

    def __init__(self, config: ModelConfig, o_bias: bool = True, **factory: Any) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        o_bias = o_bias and bias and config.architecture == "llama"
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias, **factory)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, **factory)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, **factory)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias, **factory)
        # Set by CausalLM.fuse_projections: q/k/v weights are row views of these.
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat q, k, v of `x` (one fused GEMM when the projections are fused)."""
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class MLP(nn.Module):
    """SwiGLU projections: the layer computes down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, **factory)
        self.up_proj = nn.Linear(h, i, bias=False, **factory)
        self.down_proj = nn.Linear(i, h, bias=False, **factory)
        self.gate_up_weight: torch.Tensor | None = None

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate and up projections of `x` (one fused GEMM when they are fused)."""
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return gate, up
        return self.gate_proj(x), self.up_proj(x)


class DecoderLayer(nn.Module):
    """One pre-norm attention block and one pre-norm MLP block (`model.layers.<i>.*`).

    `parallel` is the layer's place in its tensor-parallel group: the walk reduces the
    row-parallel outputs over it (`gpu_runtime.model.decoder`).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        parallel: TensorParallel = SINGLE,
        **factory: Any,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.parallel = parallel
        self.self_attn = Attention(config, o_bias=parallel.is_driver, **factory)
        self.mlp = MLP(config, **factory)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows `[vocab_start, vocab_start + rows)` of a vocabulary split over
    `parallel`'s ranks: ids outside the range embed to zero and the ranks' outputs are summed.
    At size 1 it is `nn.Embedding`."""

    def __init__(
        self,
        rows: int,
        hidden: int,
        parallel: TensorParallel = SINGLE,
        vocab_start: int = 0,
        **factory: Any,
    ) -> None:
        super().__init__(rows, hidden, **factory)
        self.parallel = parallel
        self.vocab_start = vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return self.parallel.reduce_out(out)
