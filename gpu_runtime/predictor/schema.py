"""The predictor's input contract: feature names, their meaning, and the model-shape descriptor.

Both the training code (``predictor_models``) and the runtime (``LatencyPredictor``) use these
names; an artifact's metadata lists them, and loading fails if they differ.

One row describes one decode iteration (stage 1) and, optionally, the finetune quantum running
beside it (stage 2). Stage-1 prediction ignores the finetune columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

STAGE1_FEATURES: tuple[str, ...] = (
    "batch_size",  # decode sequences in the iteration (one new token each)
    "context_tokens_total",  # sum over those sequences of tokens already in the KV cache
    "context_tokens_mean",  # context_tokens_total / batch_size
    "context_tokens_max",  # longest context in the batch
    "prefill_chunk_tokens",  # prompt tokens processed in the same iteration (chunked prefill)
    "decode_sm_share",  # decode SMs / device SMs, in (0, 1]; 1 = no spatial split
)
FINETUNE_FEATURES: tuple[str, ...] = (
    "ft_tokens",  # tokens in the finetune quantum (micro-batch x sequence length); 0 = none
    "ft_seq_len",  # sequence length of the quantum's samples
    "ft_lora_rank",  # LoRA rank r
    "ft_backward",  # 1 for a backward quantum, 0 for a forward one
    "ft_sm_share",  # SMs the quantum may use / device SMs (1 when time-shared on streams)
)
STAGE2_FEATURES: tuple[str, ...] = STAGE1_FEATURES + FINETUNE_FEATURES


class SchemaError(ValueError):
    """A feature row or model shape does not satisfy the contract."""


@dataclass(frozen=True)
class ModelShape:
    """What the latency depends on in a served model: its tensor shapes, dtype width and the
    tensor-parallel degree it is served at (a predictor is profiled per degree: an artifact
    of another degree does not match).

    Attributes:
        name: preset or deployment name (``llama3-8b``); informational, not compared.
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, vocab_size: as in the HF config (the whole model).
        dtype_bytes: bytes per weight/KV element (2 for bf16).
        tensor_parallel_size: GPUs of the engine group; the byte and FLOP figures below are
            per GPU (heads, MLP width and vocabulary split; KV heads replicated past their
            count). Metadata written before the field existed reads as 1.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if key != "name" and (not isinstance(value, int) or value <= 0):
                raise SchemaError(f"ModelShape.{key} must be a positive int, got {value!r}")

    @classmethod
    def from_model_config(
        cls, config: Any, name: str | None = None, tensor_parallel_size: int = 1
    ) -> ModelShape:
        """From a ``gpu_runtime.model.ModelConfig`` (or anything with the HF field names),
        served at `tensor_parallel_size`."""
        dtype = str(getattr(config, "dtype", "bfloat16")).replace("torch.", "")
        width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype)
        if width is None:
            raise SchemaError(f"unsupported dtype {dtype!r}")
        return cls(
            name=name or getattr(config, "name", None) or "unnamed",
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            dtype_bytes=width,
            tensor_parallel_size=tensor_parallel_size,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelShape:
        """Inverse of ``as_dict`` (SchemaError on missing or unknown keys)."""
        fields = set(cls.__dataclass_fields__)
        data = {"tensor_parallel_size": 1, **data}
        missing, unknown = fields - set(data), set(data) - fields
        if missing or unknown:
            raise SchemaError(
                f"model shape keys: missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return cls(**dict(data))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mismatches(self, other: ModelShape) -> list[str]:
        """Fields (other than name) whose values differ, as ``field: self != other`` strings."""
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{k}: {mine[k]} != {theirs[k]}" for k in mine if k != "name" and mine[k] != theirs[k]
        ]

    @property
    def q_dim(self) -> int:
        """Query width on one GPU of the engine group."""
        return self.num_attention_heads // self.tensor_parallel_size * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Key (or value) width on one GPU: its KV heads, one replica past their count."""
        return max(self.num_key_value_heads // self.tensor_parallel_size, 1) * self.head_dim

    @property
    def local_intermediate_size(self) -> int:
        """MLP width on one GPU."""
        return self.intermediate_size // self.tensor_parallel_size

    @property
    def local_vocab_size(self) -> int:
        """LM-head rows on one GPU."""
        return -(-self.vocab_size // self.tensor_parallel_size)

    @property
    def model_key(self) -> str:
        """The artifact directory's model part: the name at one GPU, `<name>-tp<t>` at t."""
        return predictor_model_key(self.name, self.tensor_parallel_size)

    @property
    def layer_linear_params(self) -> int:
        """Weights of one decoder layer's projections (q, k, v, o, gate, up, down) on one GPU."""
        h = self.hidden_size
        return (
            h * self.q_dim
            + 2 * h * self.kv_dim
            + self.q_dim * h
            + 3 * h * self.local_intermediate_size
        )

    @property
    def linear_params(self) -> int:
        """Weights every token's forward multiplies by on one GPU: all layers plus the LM
        head."""
        return (
            self.num_hidden_layers * self.layer_linear_params
            + self.local_vocab_size * self.hidden_size
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode iteration must read at least once (embedding rows excluded)."""
        return self.linear_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one cached token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.kv_dim * self.dtype_bytes

    @property
    def attention_flops_per_query_key(self) -> int:
        """FLOPs of one query attending one cached key in all layers (QK^T and PV)."""
        return 4 * self.num_hidden_layers * self.q_dim


@dataclass(frozen=True)
class DecodeIteration:
    """Stage-1 inputs for one decode iteration (see STAGE1_FEATURES)."""

    batch_size: int
    context_tokens_total: int
    context_tokens_max: int
    prefill_chunk_tokens: int = 0
    decode_sm_share: float = 1.0

    def __post_init__(self) -> None:
        if self.batch_size < 0 or self.prefill_chunk_tokens < 0:
            raise SchemaError(f"negative token counts in {self}")
        if self.batch_size + self.prefill_chunk_tokens == 0:
            raise SchemaError("an iteration needs decode sequences or prefill tokens")
        if self.context_tokens_max * self.batch_size < self.context_tokens_total:
            raise SchemaError(
                f"context_tokens_max {self.context_tokens_max} x batch "
                f"{self.batch_size} < total {self.context_tokens_total}"
            )
        if not 0.0 < self.decode_sm_share <= 1.0:
            raise SchemaError(f"decode_sm_share must be in (0, 1], got {self.decode_sm_share}")

    @classmethod
    def from_contexts(
        cls, contexts: list[int], prefill_chunk_tokens: int = 0, decode_sm_share: float = 1.0
    ) -> DecodeIteration:
        """From the per-sequence context lengths of the batch."""
        return cls(
            len(contexts),
            sum(contexts),
            max(contexts, default=0),
            prefill_chunk_tokens,
            decode_sm_share,
        )

    def row(self) -> list[float]:
        mean = self.context_tokens_total / self.batch_size if self.batch_size else 0.0
        return [
            float(self.batch_size),
            float(self.context_tokens_total),
            mean,
            float(self.context_tokens_max),
            float(self.prefill_chunk_tokens),
            self.decode_sm_share,
        ]


@dataclass(frozen=True)
class FinetuneQuantum:
    """Stage-2 inputs: the finetune work beside the iteration (see FINETUNE_FEATURES)."""

    tokens: int
    seq_len: int
    lora_rank: int
    backward: bool
    sm_share: float

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.seq_len <= 0 or self.lora_rank <= 0:
            raise SchemaError(f"invalid finetune quantum {self}")
        if not 0.0 <= self.sm_share <= 1.0:
            raise SchemaError(f"ft sm_share must be in [0, 1], got {self.sm_share}")

    def row(self) -> list[float]:
        return [
            float(self.tokens),
            float(self.seq_len),
            float(self.lora_rank),
            1.0 if self.backward else 0.0,
            self.sm_share,
        ]


def predictor_model_key(model: str, tensor_parallel_size: int = 1) -> str:
    """Where a model's artifacts live under `<root>/<gpu key>/`: its name at one GPU,
    `<name>-tp<t>` when profiled at tensor-parallel degree t."""
    return model if tensor_parallel_size == 1 else f"{model}-tp{tensor_parallel_size}"


NO_FINETUNE_ROW: tuple[float, ...] = (0.0, 1.0, 1.0, 0.0, 0.0)
"""Finetune columns meaning "nothing runs beside decode" (stage-2 prediction == stage 1)."""
