"""Start a tensor-parallel engine group in one process tree: rank 0 here, followers spawned.

`start_engine_group(source, config, size)` spawns ranks 1..size-1 (torch.multiprocessing,
spawn), joins this process to the group as rank 0, has every rank build its shard of the
model from `source`, and returns an `EngineGroup` whose `engine` is rank 0's ordinary `Engine`
(scheduler, stop rules, tokenizer, structured outputs), its runner mirrored to the followers
(`tp_runner`). Followers run `tp_follower.Follower` until `shutdown()`. With
`lora=LoraSettings(...)` every rank builds its adapter runtime over its shard and
`engine.lora` is rank 0's `MirroredLoraRuntime` (`tp_lora`): register adapters on it.
`follower_sharing(device)` builds each follower's GPU sharing (its split's streams for the
partitions rank 0 names); `follower_part(follower)` what each follower runs beside its runner
(the co-location loop's jobs: `gpu_runtime.colocation.tp_follower_jobs`). Both are pickled
into the spawned followers (module-level callables or picklable objects).

Rank `r` runs on `cuda:{k + r}` when `config.device` is `cuda:k` (`cuda` is `cuda:0`), or on
the CPU (gloo) when it is `cpu`. One engine group's rank 0 per process (a process belongs to
one `torch.distributed` world).

Failure: a rank that fails to start fails the start on every rank (`EngineGroupError` naming
it). Once running, a monitor thread watches the followers' processes: when one dies, every
later runner call on rank 0 raises `EngineGroupError` with its exit code and traceback; a call
already waiting in a collective with it fails with the group's timeout (`timeout_s`; gloo
fails at once on the closed connection). `shutdown()` (or leaving the `with` block) sends the
followers `Shutdown`, joins them (killing any that do not exit within `join_timeout_s`) and
destroys rank 0's process groups.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from gpu_runtime.distributed.control import (
    DriverChannel,
    EngineGroupError,
    FollowerChannel,
)
from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.distributed.world import init_engine_group, leave_engine_group
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.tp_follower import Follower, FollowerPartFactory
from gpu_runtime.engine.tp_lora import MirroredLoraRuntime, follower_lora
from gpu_runtime.engine.tp_messages import LoraSettings, Setup, Shutdown
from gpu_runtime.engine.tp_source import ModelSource, rank_device

__all__ = ["EngineGroup", "ModelSource", "rank_device", "start_engine_group"]


class EngineGroup:
    """A running engine group seen from rank 0: `engine`, `parallel`, `shutdown()`."""

    def __init__(
        self,
        engine: Engine,
        parallel: TensorParallel,
        channel: DriverChannel,
        processes: list[Any],
        errors: Any,
        directory: str,
        join_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.parallel = parallel
        self.channel = channel
        self.processes = processes
        self._errors = errors
        self._directory = directory
        self._join_timeout_s = join_timeout_s
        self._stopping = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch, name="engine-group-monitor", daemon=True
        )
        self._monitor.start()

    @property
    def failed(self) -> threading.Event:
        """Set once a follower died or a collective failed (`failure` says why)."""
        return self.channel.failed

    @property
    def failure(self) -> str | None:
        return self.channel.failure

    def shutdown(self) -> None:
        """Stop the followers and leave the group (idempotent)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.channel.close(Shutdown())
        except EngineGroupError:
            pass  # a follower is gone: it cannot take the message; the joins below clean up
        # after a failure the others may be held in a collective with the dead rank
        _join(self.processes, 1.0 if self.failure else self._join_timeout_s)
        self._monitor.join(timeout=self._join_timeout_s)
        leave_engine_group(self.parallel)
        shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _watch(self) -> None:
        alive = {process.sentinel: rank for rank, process in enumerate(self.processes, 1)}
        while alive:
            for sentinel in multiprocessing.connection.wait(list(alive)):
                rank = alive.pop(sentinel)
                if self._stopping.is_set():
                    continue
                process = self.processes[rank - 1]
                process.join()
                detail = _reported_error(self._errors)
                self.channel.fail(
                    f"follower rank {rank} exited with code {process.exitcode}"
                    + (f":\n{detail}" if detail else "")
                )


def start_engine_group(
    source: ModelSource,
    config: EngineConfig,
    size: int,
    *,
    tokenizer: Any | None = None,
    timeout_s: float = 600.0,
    heartbeat_s: float | None = None,
    join_timeout_s: float = 30.0,
    cpu_threads: int | None = None,
    lora: LoraSettings | None = None,
    follower_sharing: Callable[[str], Any] | None = None,
    follower_part: FollowerPartFactory | None = None,
    **engine_kwargs: Any,
) -> EngineGroup:
    """Start a `size`-rank engine group (see the module docstring); `size` >= 2.

    `timeout_s`: the collectives' timeout (a hung rank is an error after it); `heartbeat_s`:
    the keep-alive period of an idle group (default a quarter of `timeout_s`, at most 30 s);
    `cpu_threads`: `torch.set_num_threads` of each follower (None: torch's default);
    `lora`: the adapter runtime of every rank (None: no adapters); `follower_sharing`,
    `follower_part`: see the module docstring; `engine_kwargs` go to rank 0's `Engine`."""
    if size < 2:
        raise ValueError(f"an engine group has 2 or more ranks, got size {size}")
    if lora is not None and not isinstance(lora, LoraSettings):
        raise TypeError(f"lora= takes LoraSettings (every rank builds its runtime), got {lora!r}")
    context = mp.get_context("spawn")
    errors = context.Queue()
    directory = tempfile.mkdtemp(prefix="harli-engine-group-")
    init_method = f"file://{os.path.join(directory, 'rendezvous')}"
    processes = [
        context.Process(
            target=_follower_main,
            args=(
                rank,
                size,
                init_method,
                source,
                rank_device(config.device, rank),
                timeout_s,
                cpu_threads,
                errors,
                follower_sharing,
                follower_part,
            ),
            daemon=True,
            name=f"engine-group-rank-{rank}",
        )
        for rank in range(1, size)
    ]
    for process in processes:
        process.start()
    parallel: TensorParallel | None = None
    try:
        device = torch.device(rank_device(config.device, 0))  # NCCL needs the index
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel = init_engine_group(
            rank=0, size=size, init_method=init_method, device=device, timeout_s=timeout_s
        )
        channel = DriverChannel(parallel, heartbeat_s or min(30.0, timeout_s / 4))
        channel.send(Setup(config, lora))
        engine: Engine | None = None
        error = None
        try:
            model = source.build(parallel, config.device)
            runtime = None
            if lora is not None:
                runtime = MirroredLoraRuntime(model, lora, config.max_num_batched_tokens, channel)
            engine = Engine(
                model, config, tokenizer=tokenizer, control=channel, lora=runtime, **engine_kwargs
            )
        except Exception:
            error = traceback.format_exc()
        channel.gather_ready(error)
        assert engine is not None
        channel.start_keep_alive()
        return EngineGroup(engine, parallel, channel, processes, errors, directory, join_timeout_s)
    except BaseException:
        _join(processes, 0.0 if parallel is None else join_timeout_s)
        if parallel is not None:
            leave_engine_group(parallel)
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _follower_main(
    rank: int,
    size: int,
    init_method: str,
    source: ModelSource,
    device: str,
    timeout_s: float,
    cpu_threads: int | None,
    errors: Any,
    sharing_factory: Callable[[str], Any] | None,
    part_factory: FollowerPartFactory | None,
) -> None:
    """A spawned follower: join, build, report ready, follow; its traceback to `errors`."""
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        parallel = init_engine_group(
            rank=rank,
            size=size,
            init_method=init_method,
            device=torch.device(device),
            timeout_s=timeout_s,
        )
        try:
            channel = FollowerChannel(parallel)
            setup = channel.receive()
            if not isinstance(setup, Setup):
                raise EngineGroupError(f"rank {rank} expected Setup first, got {setup!r}")
            follower: Follower | None = None
            error = None
            try:
                config = dataclasses.replace(setup.config, device=device)
                model = source.build(parallel, device)
                runtime = None
                if setup.lora is not None:
                    runtime = follower_lora(model, setup.lora, config.max_num_batched_tokens)
                sharing = None if sharing_factory is None else sharing_factory(device)
                follower = Follower(model, config, channel, lora=runtime, sharing=sharing)
                if part_factory is not None:
                    follower.part = part_factory(follower)
            except Exception:
                error = traceback.format_exc()
            channel.gather_ready(error)
            assert follower is not None
            follower.run()
        finally:
            leave_engine_group(parallel)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        raise SystemExit(1) from None


def _reported_error(errors: Any) -> str | None:
    try:
        rank, text = errors.get(timeout=1.0)
    except queue.Empty:
        return None
    return f"(rank {rank}) {text}"


def _join(processes: list[Any], timeout_s: float) -> None:
    for process in processes:
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
