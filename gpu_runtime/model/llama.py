"""Llama-family decoder (Llama 3, Qwen2/2.5) with HF parameter names.

`CausalLM.forward(input_ids, positions, attention)` returns the final-normed hidden states;
`compute_logits` applies the LM head. Attention is injected per call: `None` means dense causal
SDPA over `[B, S]` (training and reference path); the decode engine passes a paged-attention
object that reads and writes its KV cache. Nothing in this module holds per-step state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.contract.model_config import ModelConfig


class AttentionFn(Protocol):
    """One attention step for one layer.

    q: `[..., n_heads, head_dim]`, k/v: `[..., n_kv_heads, head_dim]` (RoPE applied), with the
    same leading dims as the layer input (`[B, S]` dense or `[T]` flattened tokens). Returns
    `[..., n_heads, head_dim]`.
    """

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class DenseCausalAttention:
    """Causal SDPA over dense `[B, S]` batches.

    key_padding_mask: optional `[B, S]` bool, True for real tokens. Padding queries attend to
    themselves only (so no row is fully masked); their outputs are meaningless and must be
    ignored by the caller.
    """

    def __init__(self, key_padding_mask: torch.Tensor | None = None) -> None:
        self.key_padding_mask = key_padding_mask

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if q.dim() != 4:
            raise ValueError(f"dense attention needs [B, S, H, D] inputs, got q {tuple(q.shape)}")
        groups = q.shape[2] // k.shape[2]
        qt = q.transpose(1, 2)  # [B, H, S, D]
        kt = k.transpose(1, 2).repeat_interleave(groups, dim=1)
        vt = v.transpose(1, 2).repeat_interleave(groups, dim=1)
        if self.key_padding_mask is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        else:
            seq = q.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
            mask = causal[None] & self.key_padding_mask[:, None, :].to(torch.bool)
            mask = mask | torch.eye(seq, dtype=torch.bool, device=q.device)[None]
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None])
        return out.transpose(1, 2)


def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE inverse frequencies `[head_dim // 2]` in fp32, with Llama-3 scaling if configured."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[..., heads, D]`; cos/sin `[..., 1, D]` in x's dtype."""
    return x * cos + _rotate_half(x) * sin


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
    """Self-attention projections; the attention itself is the injected `AttentionFn`."""

    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        o_bias = bias and config.architecture == "llama"
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

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_idx: int,
        attention: AttentionFn,
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        q_flat, k_flat, v_flat = self.project(x)
        q = q_flat.reshape(*lead, self.num_heads, self.head_dim)
        k = k_flat.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v_flat.reshape(*lead, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = attention(layer_idx, q, k, v)
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block."""

    def __init__(self, config: ModelConfig, layer_idx: int, **factory: Any) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = Attention(config, **factory)
        self.mlp = MLP(config, **factory)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, self.layer_idx, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`model.*` of the HF layout: embeddings, layers, final norm (and RoPE frequencies)."""

    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, **factory) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


class CausalLM(nn.Module):
    """Llama-family causal LM whose `state_dict` keys equal HF's.

    `rope_inv_freq` is a non-persistent buffer; after building on the meta device, call
    `reset_rope(device)` once the module has real storage.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.model = DecoderStack(config, **factory)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv = rope_inv_freq(config, "cpu")
        self.register_buffer("rope_inv_freq", inv.to(device) if device else inv, persistent=False)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed."""
        return cast(list[DecoderLayer], list(self.model.layers))

    def reset_rope(self, device: torch.device | str) -> None:
        """Recompute the RoPE buffer on `device` (needed after `to_empty`)."""
        self.rope_inv_freq = rope_inv_freq(self.config, device)

    def rope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[..., 1, head_dim]` for integer positions `[...]` (fp32 math, cast)."""
        freqs = positions.float()[..., None] * self.rope_inv_freq  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, shape `input_ids.shape + [hidden]`.

        input_ids/positions: `[B, S]` (dense) or `[T]` (flattened, with a paged `attention`).
        """
        if input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ"
            )
        if attention is None:
            if input_ids.dim() != 2:
                raise ValueError("attention=None needs [B, S] input_ids")
            attention = DenseCausalAttention()
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        for layer in self.decoder_layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """LM head: `[..., hidden] -> [..., vocab]`."""
        return self.lm_head(hidden_states)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Serve q/k/v and gate/up from one GEMM each, for decode speed.

        Re-homes each layer's q/k/v (and gate/up) weights into one contiguous tensor and makes
        the `nn.Linear` parameters row views of it, so parameter names, values and sharing
        (same storage for the finetune tree) are unchanged. Call after the model is on its
        final device and dtype: moving it afterwards breaks the views.
        """
        for layer in self.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_weight is None:
                projections = (attn.q_proj, attn.k_proj, attn.v_proj)
                fused = torch.cat([p.weight for p in projections], dim=0)
                offset = 0
                for p in projections:
                    rows = p.weight.shape[0]
                    p.weight = nn.Parameter(fused[offset : offset + rows], requires_grad=False)
                    offset += rows
                attn.qkv_weight = fused
                if attn.q_proj.bias is not None:
                    fused_b = torch.cat([cast(torch.Tensor, p.bias) for p in projections], dim=0)
                    offset = 0
                    for p in projections:
                        rows = p.weight.shape[0]
                        p.bias = nn.Parameter(fused_b[offset : offset + rows], requires_grad=False)
                        offset += rows
                    attn.qkv_bias = fused_b
            if mlp.gate_up_weight is None:
                fused = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
                rows = mlp.gate_proj.weight.shape[0]
                mlp.gate_proj.weight = nn.Parameter(fused[:rows], requires_grad=False)
                mlp.up_proj.weight = nn.Parameter(fused[rows:], requires_grad=False)
                mlp.gate_up_weight = fused

    @torch.no_grad()
    def reserve_projection_rows(
        self, extra_rows: Mapping[str, int]
    ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """Re-home projection groups into tensors with `extra_rows[group]` zero rows after the
        base rows, so one GEMM computes the base output and `x @ extra.T` (e.g. the LoRA shrink
        of every adapter slot) together.

        Groups: "qkv" (q|k|v), "o", "gate_up" (gate|up), "down". Fuses projections first. The
        `nn.Linear` parameters (and `qkv_weight`, `qkv_bias`, `gate_up_weight`) become row views
        of the new tensors, values unchanged, so the base GEMMs read the same rows as before.
        Returns, per layer, `{group: (weight [base + extra, in], bias [base + extra] or None)}`.
        Call before building finetune trees over this model (they must see the new tensors).
        """
        self.fuse_projections()
        unknown = sorted(set(extra_rows) - {"qkv", "o", "gate_up", "down"})
        if unknown:
            raise ValueError(f"unknown projection groups {unknown}")
        result: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = []
        for layer in self.decoder_layers:
            attn, mlp = layer.self_attn, layer.mlp
            groups = {
                "qkv": (attn.q_proj, attn.k_proj, attn.v_proj),
                "o": (attn.o_proj,),
                "gate_up": (mlp.gate_proj, mlp.up_proj),
                "down": (mlp.down_proj,),
            }
            extended: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
            for group, extra in extra_rows.items():
                weight, bias = _rehome_rows(groups[group], extra)
                base = weight.shape[0] - extra
                if group == "qkv":
                    attn.qkv_weight = weight[:base]
                    attn.qkv_bias = None if bias is None else bias[:base]
                elif group == "gate_up":
                    mlp.gate_up_weight = weight[:base]
                extended[group] = (weight, bias)
            result.append(extended)
        return result


def _rehome_rows(
    projections: tuple[nn.Linear, ...], extra: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One tensor holding the projections' weights (then biases) as rows, plus `extra` zero
    rows; the parameters become views of it."""
    first = projections[0].weight
    rows = sum(p.weight.shape[0] for p in projections)
    weight = torch.zeros(rows + extra, first.shape[1], dtype=first.dtype, device=first.device)
    has_bias = projections[0].bias is not None
    bias = torch.zeros(rows + extra, dtype=first.dtype, device=first.device) if has_bias else None
    offset = 0
    for p in projections:
        n = p.weight.shape[0]
        weight[offset : offset + n].copy_(p.weight)
        p.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            bias[offset : offset + n].copy_(cast(torch.Tensor, p.bias))
            p.bias = nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return weight, bias
