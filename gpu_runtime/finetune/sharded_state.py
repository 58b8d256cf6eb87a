"""A tensor-parallel training tree's state in whole (one-GPU) shapes, and back to a rank's.

Files never hold a rank's shard: an adapter is written as one GPU would write it (PEFT format,
the whole ``lora_A`` and ``lora_B`` of every module) and a checkpoint's optimizer state has the
whole tensors' shapes too, so both load at any tensor-parallel degree. Writing gathers
(:func:`whole_adapter_state`, :func:`whole_optimizer_state`: an all-gather over the tree's
communicator along each tensor's split dimension, in rank order, keeping one copy of a KV head
held by several ranks; a tensor every rank holds whole is rank 0's), and reading cuts each
rank's slice again (:func:`local_optimizer_state`, and ``ShardShape.take`` for an adapter's
tensors). Every rank calls the gathers (they are collectives); only rank 0 writes.

At one GPU every function returns its input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.distributed.shard import ShardShape


def tree_parallel(tree: torch.nn.Module) -> tuple[TensorParallel, ShardShape | None]:
    """The tree's tensor-parallel place (its communicator and shard); ``(SINGLE, None)`` for a
    module that is no ``CausalLM`` tree."""
    parallel = getattr(tree, "parallel", SINGLE)
    shard = getattr(tree, "shard", None)
    return parallel, shard


def whole_tensor(
    parallel: TensorParallel, shard: ShardShape, name: str, local: torch.Tensor
) -> torch.Tensor:
    """The whole tensor ``name`` (a HF, peft-live or PEFT-file name) from every rank's slice
    ``local`` (a collective: every rank calls it, in the same order)."""
    split = shard.split_of(name)
    if parallel.size == 1 or split is None:
        return local
    parts = [torch.empty_like(local) for _ in range(parallel.size)]
    dist.all_gather(parts, local.contiguous(), group=parallel.group)
    kept: list[torch.Tensor] = []
    starts: set[int] = set()
    for rank, part in enumerate(parts):
        rank_split = ShardShape.of(shard.config, shard.size, rank).split_of(name)
        assert rank_split is not None
        if rank_split[1] in starts:
            continue  # another rank's copy of a KV head already kept
        starts.add(rank_split[1])
        kept.append(part)
    return torch.cat(kept, dim=split[0])


def whole_extent(shard: ShardShape, name: str) -> int:
    """The whole tensor's size along the dimension ``name`` is split on (``name`` must be
    split)."""
    last = ShardShape.of(shard.config, shard.size, shard.size - 1).split_of(name)
    assert last is not None, f"{name} is not split"
    return last[2]


def whole_adapter_state(
    tree: torch.nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` (PEFT file keys -> this rank's tensors) with every tensor whole."""
    parallel, shard = tree_parallel(tree)
    if parallel.size == 1 or shard is None:
        return dict(state)
    return {key: whole_tensor(parallel, shard, key, tensor) for key, tensor in state.items()}


def whole_optimizer_state(
    tree: torch.nn.Module, names: Sequence[str], state: dict[str, Any]
) -> dict[str, Any]:
    """An optimizer ``state_dict`` over the parameters ``names`` (in order) with each
    per-parameter tensor shaped like its parameter's slice made whole (AdamW's moments);
    scalars (``step``) and the param groups as they are."""
    parallel, shard = tree_parallel(tree)
    if parallel.size == 1 or shard is None:
        return state
    whole: dict[int, dict[str, Any]] = {}
    for index, per_param in sorted(state["state"].items()):
        name = names[index]
        whole[index] = {
            key: whole_tensor(parallel, shard, name, value) if _is_moment(value) else value
            for key, value in per_param.items()
        }
    return {"state": whole, "param_groups": state["param_groups"]}


def local_optimizer_state(
    tree: torch.nn.Module, names: Sequence[str], state: dict[str, Any]
) -> dict[str, Any]:
    """The inverse of :func:`whole_optimizer_state`: this rank's slice of each moment."""
    parallel, shard = tree_parallel(tree)
    if parallel.size == 1 or shard is None:
        return state
    local: dict[int, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        name = names[int(index)]
        local[int(index)] = {
            key: shard.take(name, value).clone() if _is_moment(value) else value
            for key, value in per_param.items()
        }
    return {"state": local, "param_groups": state["param_groups"]}


def every_rank(parallel: TensorParallel, value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (pickled, over the control group)."""
    if parallel.size == 1:
        return [value]
    values: list[Any] = [None] * parallel.size
    dist.all_gather_object(values, value, group=parallel.control_group)
    return values


def _is_moment(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0
