"""Validated configuration of a Llama-family decoder (Llama 3, Qwen2/2.5).

The same object describes the serving model, the finetune engine's module tree and the HF
reference models built in tests (through `to_hf_config`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")
_HF_ARCH_NAMES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


class ModelConfigError(ValueError):
    """A model configuration is invalid; the message names the field and its value."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family causal LM."""

    architecture: str
    """"llama" (Llama 2/3) or "qwen2" (Qwen2/2.5: bias on the q/k/v projections)."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP (gate/up output, down input)."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (GQA); divides num_attention_heads."""
    head_dim: int
    """Width of one attention head; usually hidden_size // num_attention_heads."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """None, or a Llama-3 style dict: rope_type "llama3", factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + output) the model accepts."""
    tie_word_embeddings: bool = False
    """True when lm_head shares the embedding matrix."""
    attention_bias: bool = False
    """True when q/k/v projections carry a bias (always true for qwen2; for llama it also adds
    an o_proj bias, as HF does)."""
    dtype: str = "bfloat16"
    """Parameter dtype name: float32, bfloat16 or float16."""
    bos_token_id: int | None = None
    """Token that starts a sequence, if the tokenizer uses one."""
    eos_token_id: int | list[int] | None = None
    """Token(s) that end generation."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Other HF config keys, carried through unchanged."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelConfigError(f"architecture={self.architecture!r} not in {ARCHITECTURES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if not 0 < self.rms_norm_eps < 1:
            raise ModelConfigError(f"rms_norm_eps={self.rms_norm_eps} must be in (0, 1)")
        if self.rope_theta <= 0:
            raise ModelConfigError(f"rope_theta={self.rope_theta} must be positive")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"dtype={self.dtype!r} not in {DTYPES}")
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ModelConfigError("architecture='qwen2' requires attention_bias=True")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind == "default":
                object.__setattr__(self, "rope_scaling", None)
            elif kind != "llama3":
                raise ModelConfigError(f"rope_scaling type {kind!r} unsupported (only 'llama3')")
            else:
                missing = [k for k in _LLAMA3_SCALING_KEYS if k not in self.rope_scaling]
                if missing:
                    raise ModelConfigError(f"rope_scaling={self.rope_scaling} lacks {missing}")
                if self.rope_scaling["low_freq_factor"] >= self.rope_scaling["high_freq_factor"]:
                    raise ModelConfigError(
                        f"rope_scaling low_freq_factor={self.rope_scaling['low_freq_factor']} "
                        f"must be < high_freq_factor={self.rope_scaling['high_freq_factor']}"
                    )

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids as a list (possibly empty)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def num_parameters(self) -> int:
        """Parameter count (embedding and head counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv + (h if self.architecture == "llama" else 0)
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * layer + h + head

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return (
            2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
        ) * bytes_per_element

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a HF `config.json` dict (legacy `rope_theta`/`rope_scaling` keys or the
        newer `rope_parameters`)."""
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ModelConfigError(f"model_type={model_type!r} not in {ARCHITECTURES}")
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta: float = float(hf.get("rope_theta") or rope_params.pop("rope_theta", 10000.0))
        rope_scaling = hf.get("rope_scaling") or (rope_params or None)
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
            if rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
                rope_scaling = None
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        known = {
            "model_type",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "max_position_embeddings",
            "tie_word_embeddings",
            "attention_bias",
            "torch_dtype",
            "dtype",
            "bos_token_id",
            "eos_token_id",
            "architectures",
        }
        return cls(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            dtype=str(dtype).replace("torch.", ""),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A HF `config.json` dict that `LlamaConfig`/`Qwen2Config` (and PEFT) accept."""
        out: dict[str, Any] = dict(self.extra)
        out.update(
            architectures=[_HF_ARCH_NAMES[self.architecture]],
            model_type=self.architecture,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            torch_dtype=self.dtype,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        return out

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """Named shapes: "tiny" (tests); "llama3-8b", "qwen2.5-7b", "llama3-70b" and
        "qwen2.5-72b" (benchmarks, random weights; the 70B-class ones are served sharded)."""
        if name not in _PRESETS:
            known = ", ".join(_PRESETS)
            raise ModelConfigError(f"unknown preset {name!r}; known: {known}")
        return cls(**copy.deepcopy(_PRESETS[name]))


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3 = dict(
    architecture="llama",
    vocab_size=128256,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=_LLAMA3_ROPE,
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_id=[128001, 128009],
)
_QWEN25 = dict(
    architecture="qwen2",
    vocab_size=152064,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    attention_bias=True,
    bos_token_id=151643,
    eos_token_id=151645,
)
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architecture="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
        dtype="float32",
    ),
    "llama3-8b": _LLAMA3
    | dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "qwen2.5-7b": _QWEN25
    | dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
    "llama3-70b": _LLAMA3
    | dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "qwen2.5-72b": _QWEN25
    | dict(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
}
