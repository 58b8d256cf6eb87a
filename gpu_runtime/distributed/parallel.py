"""A rank's place in its tensor-parallel engine group, and the collectives the model runs.

Megatron-style tensor parallelism needs four operations at fixed seams of the decoder walk
(`gpu_runtime.model.decoder`):

* `copy_in`: before a column-parallel projection (q|k|v, gate|up, the LM head). Identity
  forward; in backward the input's gradient is the sum of every rank's partial gradient, so it
  is all-reduced.
* `reduce_out`: after a row-parallel projection (o, down) and the vocab-parallel embedding.
  Each rank holds a partial sum; forward all-reduces it; backward is identity.
* `gather_last`: the vocab-parallel logits, all-gathered along the last dimension so every
  rank holds the full row (backward: each rank keeps its slice of the gradient).
* `all_reduce_`: a plain in-place sum, for gradients of parameters every rank holds whole.

At size 1 every operation returns its input untouched and nothing is communicated, so a
single-GPU engine runs exactly the code it ran before tensor parallelism existed. Without
grad mode the reductions run in place on the projection's fresh output (no copy), which is
what the CUDA-graph decode path captures; NCCL collectives are graph-capturable.

`group` is the decode communicator; `finetune_group` is a second communicator over the same
ranks, so a finetune quantum's collectives (issued on its own stream) can never interleave
with decode's on one communicator and deadlock; `control_group` is a gloo group over the same
ranks for host-side objects (the broadcast step and plan). One `TensorParallel` per rank per
engine group; it holds no per-step state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size` in one engine group (see the module docstring)."""

    rank: int = 0
    """This process's rank in the engine group; rank 0 schedules and plans."""
    size: int = 1
    """Ranks in the group (its tensor-parallel degree)."""
    group: Any = field(default=None, compare=False)
    """The decode communicator (a `ProcessGroup`); None at size 1."""
    finetune_group: Any = field(default=None, compare=False)
    """The finetune communicator over the same ranks; None at size 1."""
    control_group: Any = field(default=None, compare=False)
    """A gloo group over the same ranks for Python objects; None at size 1."""
    finetune_control_group: Any = field(default=None, compare=False)
    """A gloo group for the finetune side's Python objects (a checkpoint's gathers, which run
    in a quantum while `control_group` carries rank 0's messages); None: `control_group`."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.size - 1}")
        if self.size > 1 and (self.group is None or self.control_group is None):
            raise ValueError(f"size {self.size} needs a decode group and a control group")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that schedules, plans and answers requests."""
        return self.rank == 0

    def for_finetune(self) -> TensorParallel:
        """The same ranks, with the finetune communicator as the one collectives use."""
        if self.size == 1:
            return self
        objects = self.finetune_control_group or self.control_group
        return TensorParallel(
            self.rank, self.size, self.finetune_group, self.finetune_group, objects, objects
        )

    def copy_in(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, gradient all-reduced backward (before column-parallel work)."""
        if self.size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        result: torch.Tensor = _CopyIn.apply(x, self.group)
        return result

    def reduce_out(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks forward, identity backward (after row-parallel work)."""
        if self.size == 1:
            return x
        if torch.is_grad_enabled() and x.requires_grad:
            result: torch.Tensor = _ReduceOut.apply(x, self.group)
            return result
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        if torch.is_grad_enabled() and x.requires_grad:
            result: torch.Tensor = _GatherLast.apply(x, self.group, self.rank, self.size)
            return result
        return _gather_last(x, self.group, self.size)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (no autograd)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_from_driver_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` written into `x` on every rank, over the decode group (in place; the
        identity at size 1). The engine's sampled tokens: rank 0 samples, every rank uses them.
        On CUDA it is queued on the current stream's order without a host sync."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (pickled, over the control group)."""
        if self.size == 1:
            return value
        box = [value if self.is_driver else None]
        dist.broadcast_object_list(box, group=self.control_group, group_src=0)
        return box[0]


SINGLE = TensorParallel()
"""The one-GPU placement: every collective is the identity."""


def _gather_last(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        return _gather_last(x, group, size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start = ctx.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None, None, None
