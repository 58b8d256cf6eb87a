"""Which slice of each HF-named tensor a tensor-parallel rank holds.

The rule per tensor, by the role of its module (Megatron layout; S-LoRA / vLLM for adapters):

| tensor | split |
| --- | --- |
| `q_proj` weight, bias | rows of this rank's query heads |
| `k_proj`, `v_proj` weight, bias | rows of this rank's KV heads (a replica when size > KV heads) |
| `gate_proj`, `up_proj` weight | rows `[rank * I/size, (rank + 1) * I/size)` |
| `o_proj`, `down_proj` weight | the same ranges, as columns (row-parallel) |
| `o_proj` bias | whole on rank 0, absent elsewhere (added once, before the sum) |
| `embed_tokens`, `lm_head` weight | rows of this rank's vocabulary range (zero rows pad the last) |
| norms | whole on every rank |
| `lora_A` of a column-parallel module | whole (every rank shrinks the full input) |
| `lora_B` of a column-parallel module | rows, as the base weight's |
| `lora_A` of a row-parallel module | columns, as the base weight's |
| `lora_B` of a row-parallel module | whole |

The partial shrink of a row-parallel `lora_A` is summed with the base output: a LoRA term of a
row-parallel projection needs no collective of its own: every rank adds
`B (A_r x_r)` to its partial output before the one all-reduce, and the sum over ranks is
`B A x`. Parameters held whole on every rank whose gradient depends on the rank's shard
(`lora_A` of column-parallel, `lora_B` of row-parallel modules) have their gradients summed
over ranks before the optimizer step (`replicated_gradient`).

Only names and shapes are read here: slicing works on a tensor or on a lazy safetensors slice
(`get_slice`), so a rank reads only its own bytes from a checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.tensor_parallel import (
    check_tensor_parallel,
    kv_head_of_rank,
    kv_heads_per_rank,
)

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections whose output features are split across ranks."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Projections whose input features are split (their outputs are summed over ranks)."""


@dataclass(frozen=True)
class ShardShape:
    """The shapes rank `rank` of `size` holds of the model `config`."""

    config: ModelConfig
    size: int
    rank: int
    num_heads: int
    """Query heads on this rank."""
    num_kv_heads: int
    """KV heads on this rank (1 when replicated)."""
    kv_head_start: int
    """The first global KV head this rank holds."""
    intermediate_size: int
    """MLP width on this rank."""
    vocab_per_rank: int
    """Embedding and LM-head rows on this rank (the vocabulary padded to `size` equal parts)."""

    @classmethod
    def of(cls, config: ModelConfig, size: int = 1, rank: int = 0) -> ShardShape:
        check_tensor_parallel(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        return cls(
            config=config,
            size=size,
            rank=rank,
            num_heads=config.num_attention_heads // size,
            num_kv_heads=kv_heads_per_rank(config, size),
            kv_head_start=kv_head_of_rank(config, size, rank),
            intermediate_size=config.intermediate_size // size,
            vocab_per_rank=-(-config.vocab_size // size),
        )

    @property
    def vocab_start(self) -> int:
        """The first vocabulary row this rank holds."""
        return self.rank * self.vocab_per_rank

    def local_config(self) -> ModelConfig:
        """The config whose modules have this rank's shapes (the config itself at size 1).

        Its `vocab_size` is the rank's padded vocabulary slice; the model's `config` stays the
        global one (what tokenizers, samplers and checkpoints see).
        """
        if self.size == 1:
            return self.config
        return dataclasses.replace(
            self.config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_per_rank,
        )

    def split_of(self, name: str) -> tuple[int, int, int] | None:
        """`(dim, start, stop)` of tensor `name` this rank holds, or None when it holds all.

        `stop` may pass the tensor's end for the vocabulary (the rows past it are zero).
        """
        parts = name.split(".")
        if self.size == 1 or parts[-1] not in ("weight", "bias"):
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (0, self.vocab_start, self.vocab_start + self.vocab_per_rank)
        d = self.config.head_dim
        lora, module = _lora_and_module(parts)
        if module in COLUMN_PARALLEL:
            if lora == "lora_A":
                return None
            if module == "q_proj":
                start, count = self.rank * self.num_heads * d, self.num_heads * d
            elif module in ("k_proj", "v_proj"):
                start, count = self.kv_head_start * d, self.num_kv_heads * d
            else:
                start, count = self.rank * self.intermediate_size, self.intermediate_size
            return (0, start, start + count)
        if module in ROW_PARALLEL:
            if lora == "lora_B" or parts[-1] == "bias":
                return None
            width = self.num_heads * d if module == "o_proj" else self.intermediate_size
            return (1, self.rank * width, (self.rank + 1) * width)
        return None

    def holds(self, name: str) -> bool:
        """False for a row-parallel bias off rank 0 (it is added once, on rank 0)."""
        parts = name.split(".")
        return not (parts[-1] == "bias" and parts[-2] in ROW_PARALLEL and self.rank != 0)

    def take(self, name: str, tensor: Any) -> Any:
        """This rank's slice of the full tensor `name` (a tensor or a safetensors slice).

        Returns a tensor; a vocabulary slice past the end is padded with zero rows.
        """
        split = self.split_of(name)
        if split is None:
            return tensor[:] if not hasattr(tensor, "shape") else tensor
        dim, start, stop = split
        full = tensor.get_shape()[dim] if hasattr(tensor, "get_shape") else tensor.shape[dim]
        end = min(stop, full)
        piece = tensor[start:end] if dim == 0 else tensor[:, start:end]
        if end < stop:
            pad = list(piece.shape)
            pad[0] = stop - end
            piece = torch.cat([piece, piece.new_zeros(pad)], dim=0)
        return piece

    def is_replicated_gradient(self, name: str) -> bool:
        """True for a trainable tensor every rank holds whole but whose gradient each rank
        computes only in part (summed over ranks before the optimizer step)."""
        lora, module = _lora_and_module(name.split("."))
        if lora is None or self.size == 1:
            return False
        return (lora == "lora_A" and module in COLUMN_PARALLEL) or (
            lora == "lora_B" and module in ROW_PARALLEL
        )


def _lora_and_module(parts: list[str]) -> tuple[str | None, str]:
    """(`lora_A` / `lora_B` / None, the projection's name) of a dotted tensor name; peft's
    live names carry the adapter name after `lora_A` (`q_proj.lora_A.default.weight`)."""
    for index, part in enumerate(parts):
        if part in ("lora_A", "lora_B"):
            return part, parts[index - 1]
    return None, parts[-2] if len(parts) > 1 else ""
