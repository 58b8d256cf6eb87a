"""What the engine needs from a multi-adapter (LoRA) runtime, as a protocol.

`gpu_runtime.finetune.lora_serving.MultiLoraRuntime` implements it; the engine only calls these
methods, so it does not import the finetune package. Contract:

- `has(name)` / `names()`: the adapters that can be served (request validation, `/v1/models`).
- `can_admit(name)`: `attach` would succeed now (the adapter is resident in a GPU slot, or a slot
  is held by no request). `attach(request_id, name)` takes a slot reference for the request and
  returns the slot; `detach(request_id)` drops it (ignored for requests without an adapter).
- `set_batch(order)`: gives this step's tokens their slots, `order` = `(request_id, num_tokens)`
  in token order; returns True when some token uses an adapter.
- `forward(input_ids, positions, attention)`: hidden states like `CausalLM.forward`, plus the
  per-token LoRA terms of the last `set_batch`; tokens of requests without an adapter get exactly
  the base model's hidden states.
- `slot_of_request(request_id)`: the slot an attached request uses (-1: none); fixed while the
  request stays attached (a held slot is never evicted).
- `decode_groups()`: per layer, the stacked slots of each fused projection group (`LoraGroup`,
  keys in `GROUP_MODULES`), for the CUDA decode step that adds the LoRA terms inside its
  captured graph: the tensors are fixed storage written in place when slots change, so graphs
  stay valid; the per-row slots are a static input of the graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_runtime.model.attention import AttentionFn

GROUP_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""Projection groups in the order of the serving model's fused GEMM outputs (q|k|v, gate|up)."""


@dataclass(frozen=True)
class LoraGroup:
    """Adapter slots of one projection group of one layer, stacked for the decode step.

    With `S` slots of rank `R` (zero-padded) and the group's `G` modules:
    - `a` `[G * S * R, in]`: row `g*S*R + s*R + r` is row `r` of module g's A in slot s, so one
      GEMM `x @ a.T` gives every module's shrink for every slot (`[T, G*S*R]`);
    - `b` `[S * R, out_total]`: row `s*R + r`, columns of module g at its offset in the fused
      output (q|k|v or gate|up), holding `scaling * B.T` (zeros for untargeted modules);
    - `bounds`: output column where modules 1.. start (`len == G - 1`).
    - `weight`, `bias` (optional): the serving model's fused weight of the group with `a` as
      its last rows (`CausalLM.reserve_projection_rows`), so one GEMM gives the base output and
      the shrink together.
    """

    a: torch.Tensor
    b: torch.Tensor
    bounds: tuple[int, ...]
    max_rank: int
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


class LoraForward(Protocol):
    """`(input_ids [T], positions [T], attention) -> hidden [T, hidden_size]`."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn | None = ...
    ) -> torch.Tensor: ...


class LoraRuntime(Protocol):
    """Adapters by name for one serving model (see the module docstring)."""

    @property
    def forward(self) -> LoraForward: ...

    def has(self, name: str) -> bool: ...

    def names(self) -> list[str]: ...

    def can_admit(self, name: str) -> bool: ...

    def attach(self, request_id: str, name: str) -> int: ...

    def detach(self, request_id: str) -> None: ...

    def set_batch(self, order: Sequence[tuple[str, int]]) -> bool: ...

    def slot_of_request(self, request_id: str) -> int: ...

    def decode_groups(self) -> Sequence[Mapping[str, LoraGroup]]: ...


def lora_expand_add_reference(
    out: torch.Tensor, shrink: torch.Tensor, group: LoraGroup, slots: torch.Tensor
) -> None:
    """Torch form of the expand kernel (CPU, and the GPU tests' reference), in place.

    out `[T, out_total]`, shrink `[T, G*S*R]` (`x @ group.a.T`), slots `[T]` (-1: base row).
    Row t of a slot s gets `shrink[t, module g, slot s] @ b[slot s, module g's columns]` added;
    rows with slot -1 are not written (bit-identical to the base output).
    """
    rank = group.max_rank
    width = group.b.shape[0]  # S * R
    rows = (slots >= 0).nonzero()[:, 0]
    if rows.numel() == 0:
        return
    row_slots = slots[rows].long()
    column_slot = torch.arange(width, device=out.device) // rank
    mask = (column_slot[None, :] == row_slots[:, None]).to(torch.float32)  # [T', S*R]
    starts = (0, *group.bounds)
    ends = (*group.bounds, out.shape[1])
    for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
        part = shrink[rows, g * width : (g + 1) * width].float() * mask
        delta = part @ group.b[:, start:end].float()
        out[rows, start:end] = (out[rows, start:end].float() + delta).to(out.dtype)


def _expand_add_(
    out: torch.Tensor, shrink: torch.Tensor, group: LoraGroup, slots: torch.Tensor
) -> None:
    if out.is_cuda:
        from gpu_runtime.engine.lora_kernels import lora_expand_add_

        lora_expand_add_(out, shrink, group, slots)
    else:
        lora_expand_add_reference(out, shrink, group, slots)


def apply_lora_group_(
    out: torch.Tensor, x: torch.Tensor, group: LoraGroup, slots: torch.Tensor
) -> None:
    """`out += LoRA(x)` per row's slot for one projection group, in place (two kernels on CUDA:
    the shrink GEMM over all slots and the gathered expand-add). x `[T, in]`, out `[T, out]`."""
    _expand_add_(out, torch.nn.functional.linear(x, group.a), group, slots)


def linear_and_shrink(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: LoraGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`F.linear(x, weight, bias)`, shrink `x @ group.a.T`): one GEMM when the group's A rows
    sit below `weight` (`group.weight`; both results are column views of its output), else
    two."""
    if group.weight is None:
        return torch.nn.functional.linear(x, weight, bias), torch.nn.functional.linear(x, group.a)
    full = torch.nn.functional.linear(x, group.weight, group.bias)  # [T, out + G*S*R]
    base = weight.shape[0]
    return full[:, :base], full[:, base:]


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: LoraGroup | None,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` plus each row's LoRA term of `group` (rows' `slots`, -1:
    none). With `group.weight` (the base rows then `a`) it is one GEMM whose first columns are
    the output (a strided view) and whose last columns are the shrink, then the expand-add."""
    if group is None or slots is None:
        return torch.nn.functional.linear(x, weight, bias)
    out, shrink = linear_and_shrink(x, weight, bias, group)
    _expand_add_(out, shrink, group, slots)
    return out
