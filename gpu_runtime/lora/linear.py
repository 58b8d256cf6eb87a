"""A projection plus each row's LoRA term: what the decode step calls per projection group.

`lora_linear(x, weight, bias, group, slots)` is `F.linear` plus, for each row of `x`, the term
of the adapter in that row's slot (-1: none, the row stays bit-identical to the base output):
one shrink GEMM over every slot (`x @ group.a.T`, or the same GEMM as the base projection when
the group's A rows sit below the serving weight) and one expand-add of each row's own slot, the
Triton kernel on CUDA (:mod:`gpu_runtime.lora.expand_kernel`, imported there only: Triton is a
CUDA host's dependency) and :func:`~gpu_runtime.lora.groups.lora_expand_add_reference` elsewhere.
"""

from __future__ import annotations

import torch

from gpu_runtime.lora.groups import LoraGroup, lora_expand_add_reference


def _expand_add_(
    out: torch.Tensor, shrink: torch.Tensor, group: LoraGroup, slots: torch.Tensor
) -> None:
    if out.is_cuda:
        from gpu_runtime.lora.expand_kernel import lora_expand_add_

        lora_expand_add_(out, shrink, group, slots)
    else:
        lora_expand_add_reference(out, shrink, group, slots)


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
