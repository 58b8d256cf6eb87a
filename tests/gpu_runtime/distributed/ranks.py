"""Run a function on every rank of an engine group, in spawned processes.

`run_ranks(size, fn, *args, device="cpu")` starts `size` processes, each joining one engine
group through `init_engine_group` (a `file://` rendezvous in a fresh directory; gloo on CPU,
NCCL with rank r on `cuda:r` when `device="cuda"`) and calling `fn(parallel, *args)`. It
returns each rank's result, in rank order, and raises with the failing rank's traceback when
one fails. `fn` must be importable (a module-level function).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.distributed.world import init_engine_group, leave_engine_group

RANK_TIMEOUT_S = 300.0
"""A rank that takes longer has deadlocked (the group's collectives time out at this too)."""


def _rank_main(
    rank: int,
    size: int,
    init_method: str,
    device_kind: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        device = torch.device("cpu")
        if device_kind == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        parallel = init_engine_group(
            rank=rank,
            size=size,
            init_method=init_method,
            device=device,
            timeout_s=RANK_TIMEOUT_S,
        )
        try:
            results.put((rank, True, fn(parallel, *args)))
        finally:
            leave_engine_group(parallel)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(size: int, fn: Callable[..., Any], *args: Any, device: str = "cpu") -> list[Any]:
    """`fn(parallel, *args)` on each of `size` ranks (gloo on CPU, NCCL on `device="cuda"`);
    the results in rank order (CUDA tensors should be moved to the CPU before returning)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        init_method = f"file://{os.path.join(directory, 'rendezvous')}"
        processes = [
            context.Process(
                target=_rank_main,
                args=(rank, size, init_method, device, fn, args, results),
            )
            for rank in range(size)
        ]
        for process in processes:
            process.start()
        collected: dict[int, Any] = {}
        failures: list[str] = []
        try:
            for _ in range(size):
                rank, ok, value = results.get(timeout=RANK_TIMEOUT_S + 60)
                if ok:
                    collected[rank] = value
                else:
                    failures.append(f"rank {rank}:\n{value}")
                    break
        finally:
            for process in processes:
                process.join(timeout=30 if not failures else 1)
                if process.is_alive():
                    process.kill()
        if failures:
            raise AssertionError("\n".join(failures))
    return [collected[rank] for rank in range(size)]


def single(parallel: TensorParallel) -> bool:
    """A rank function for a smoke check: True on every rank."""
    return parallel.size >= 1
