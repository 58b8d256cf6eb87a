"""A tensor-parallel training tree's state in whole (one-GPU) shapes, and back to a rank's.

Files never hold a rank's shard: an adapter is written as one GPU would write it (PEFT format,
the whole ``lora_A`` and ``lora_B`` of every module) and a checkpoint's optimizer state has the
whole tensors' shapes too, so both load at any tensor-parallel degree. Writing gathers
(:func:`whole_adapter_state`, :func:`whole_optimizer_state`: one all-gather of one flat buffer
over the tree's communicator, each tensor then joined along its split dimension in rank order,
keeping one copy of a KV head held by several ranks; a tensor every rank holds whole is rank
0's), and reading cuts each rank's slice again (:func:`local_optimizer_state`, and
``ShardShape.take`` for an adapter's tensors). Every rank calls the gathers (they are
collectives); only rank 0 writes.

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


def whole_tensors(
    parallel: TensorParallel, shard: ShardShape, named: Sequence[tuple[str, torch.Tensor]]
) -> list[torch.Tensor]:
    """The whole tensors of ``named`` (HF, peft-live or PEFT-file names -> this rank's slices),
    in order: a collective every rank calls with the same names, one all-gather of one flat
    buffer over the tree's communicator for all the split ones (of one dtype)."""
    split = [(i, name, t) for i, (name, t) in enumerate(named) if shard.split_of(name)]
    whole = [tensor for _, tensor in named]
    if parallel.size == 1 or not split:
        return whole
    dtypes = {t.dtype for _, _, t in split}
    if len(dtypes) != 1:
        raise ValueError(f"tensors to gather have several dtypes {sorted(map(str, dtypes))}")
    flat = torch.cat([t.reshape(-1) for _, _, t in split])
    parts = [torch.empty_like(flat) for _ in range(parallel.size)]
    dist.all_gather(parts, flat, group=parallel.group)
    ranks = [ShardShape.of(shard.config, shard.size, r) for r in range(shard.size)]
    offset = 0
    for index, name, local in split:
        own = shard.split_of(name)
        assert own is not None
        kept: list[torch.Tensor] = []
        starts: set[int] = set()
        for rank, part in zip(ranks, parts, strict=True):
            rank_split = rank.split_of(name)
            assert rank_split is not None
            if rank_split[1] not in starts:  # a KV head several ranks hold is kept once
                starts.add(rank_split[1])
                kept.append(part[offset : offset + local.numel()].view(local.shape))
        whole[index] = torch.cat(kept, dim=own[0])
        offset += local.numel()
    return whole


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
    named = list(state.items())
    return dict(zip(state, whole_tensors(parallel, shard, named), strict=True))


def whole_optimizer_state(
    tree: torch.nn.Module, names: Sequence[str], state: dict[str, Any]
) -> dict[str, Any]:
    """An optimizer ``state_dict`` over the parameters ``names`` (in order) with each
    per-parameter tensor shaped like its parameter's slice made whole (AdamW's moments);
    scalars (``step``) and the param groups as they are."""
    parallel, shard = tree_parallel(tree)
    if parallel.size == 1 or shard is None:
        return state
    slots = [
        (index, key, names[index], value)
        for index, per_param in sorted(state["state"].items())
        for key, value in per_param.items()
        if _is_moment(value)
    ]
    gathered = whole_tensors(parallel, shard, [(name, value) for _, _, name, value in slots])
    whole: dict[int, dict[str, Any]] = {i: dict(p) for i, p in state["state"].items()}
    for (index, key, _, _), tensor in zip(slots, gathered, strict=True):
        whole[index][key] = tensor
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
