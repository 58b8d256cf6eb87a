"""Stacked adapter slots of one projection group (`LoraGroup`) and the torch form of the expand.

A decode step's projection groups are those of the serving model's fused GEMMs (`GROUP_MODULES`:
q|k|v, o, gate|up, down). `LoraGroup` is the layout the stacked slots have in GPU memory
(:class:`gpu_runtime.lora.stacked.StackedLoraWeights` builds them);
:func:`lora_expand_add_reference` is the exact torch form of the expand step that
:mod:`gpu_runtime.lora.expand_kernel` runs on CUDA (the CPU path, the kernel's fallback for
odd shapes, and the GPU tests' reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
