"""Start one engine group's processes' communicators.

An engine group is its own `torch.distributed` world: `size` processes, one per GPU (rank `r`
drives the group's `r`-th GPU), rendezvous at `init_method` (a `tcp://host:port` or
`file://` address private to the group), so two groups on one host never share a
communicator. Each rank gets three groups over the same ranks: decode (the default group;
NCCL on CUDA, gloo on CPU), finetune (a second communicator of the same backend, so the two
engines' collectives never interleave on one), and control (gloo, for Python objects).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from gpu_runtime.distributed.parallel import SINGLE, TensorParallel


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA devices, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_engine_group(
    *,
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float = 600.0,
) -> TensorParallel:
    """Join rank `rank` of a `size`-rank engine group; `SINGLE` (nothing started) at size 1.

    On CUDA the process must already have `torch.cuda.set_device` its GPU.
    """
    if size == 1:
        return SINGLE
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed world")
    backend = backend_for(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    ranks = list(range(size))
    decode = dist.group.WORLD
    finetune = dist.new_group(ranks, backend=backend, timeout=timeout)
    control = dist.new_group(ranks, backend="gloo", timeout=timeout) if backend != "gloo" else None
    return TensorParallel(
        rank=rank,
        size=size,
        group=decode,
        finetune_group=finetune,
        control_group=control or dist.new_group(ranks, backend="gloo", timeout=timeout),
        # a gloo finetune communicator carries its objects too; beside NCCL, a gloo one
        finetune_control_group=(
            finetune
            if backend == "gloo"
            else dist.new_group(ranks, backend="gloo", timeout=timeout)
        ),
    )


def leave_engine_group(parallel: TensorParallel) -> None:
    """Tear down this process's communicators (no-op at size 1)."""
    if parallel.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
