"""How a decode host is assembled around a model already on its device: the engine with its GPU
sharing and decode graphs, the unified pool when it has one (`build_serving_engine`), and the
co-location loop over them (`build_host_loop`). The host agent builds with these
(`serving.EngineSpec`, `runtime.HostRuntime`), and so do the benchmarks, so a benchmarked host is
the deployed one; whatever a caller sets differently is an explicit argument.

Order (the unified pool's contract, `gpu_runtime.memory.HostMemory`): the pool is built after the
weights and the LoRA runtime are on the device, the engine over the pool's KV range, its decode
graphs captured once per SM split (a graph runs on the SMs of the context it was captured in),
then the pool is told decode is ready; the loop is bound to the pool once built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_runtime.agent.config import DEFAULT_DECODE_GROUPS
from gpu_runtime.colocation import CoLocationPolicy, HostLoop, IterationRecord
from gpu_runtime.colocation.executor import QuantumExecutor
from gpu_runtime.colocation.loop import LAUNCH_DURING_DECODE
from gpu_runtime.engine import Engine, EngineConfig, RequestOutput
from gpu_runtime.memory import HostMemory, MemoryManagerConfig, build_host_memory

HOST_MEMORY_CONFIG = MemoryManagerConfig(plan_peak_window=256)
"""The pool's policy on a host: quanta in the shared graph pool are planned beside decode's
peak over the last 256 quantum boundaries (the memory bench's `--plan-peak-window`), so that a
burst's reclaims are cap changes; a quantum without recomputation that fits only the release
plan (growth headroom alone) runs in a graph pool of its own, released between quanta when
decode grows (the bench's `unified_release`; `HostLoop(release_graph_shapes=True)`)."""


@dataclass(frozen=True)
class ServingEngine:
    """An engine and, when it has one, the unified pool its KV cache lives in."""

    engine: Engine
    memory: HostMemory | None
    sharing: Any = None
    """The `gpu_runtime.sharing.GpuSharing` of a CUDA host (None on CPU)."""
    group: Any = None
    """At tensor-parallel degree > 1, the `EngineGroup` whose rank 0 `engine` is (its
    `shutdown()` stops the followers); None at degree 1."""

    def close(self) -> None:
        """Release the pool and stop the engine group's followers (each when there is one)."""
        if self.memory is not None:
            self.memory.close()
        if self.group is not None:
            self.group.shutdown()


def host_sharing(device: str, decode_groups: tuple[int, ...] | None) -> Any:
    """The GPU sharing of a host on `device`: green-context SM splits of `decode_groups` (units
    of the SM granularity; None: every split), or prioritised streams where the driver cannot
    split; None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    from gpu_runtime.sharing import create_sharing

    return create_sharing(torch.device(device), decode_groups=decode_groups)


def capture_decode_graphs(engine: Engine, sharing: Any) -> None:
    """Decode graphs per batch bucket, once per SM split of `sharing` (on the whole device's
    current stream without one)."""
    if sharing is None:
        engine.capture_cuda_graphs()
        return
    for decode_sms in sharing.table.choices:
        engine.capture_cuda_graphs(
            partition=decode_sms, stream=sharing.partition(decode_sms)[0], sm_count=decode_sms
        )


def build_serving_engine(
    model: Any,
    config: EngineConfig,
    *,
    memory_pool: bool,
    tokenizer: Any = None,
    lora: Any = None,
    pool_bytes: int | None = None,
    memory_config: MemoryManagerConfig = HOST_MEMORY_CONFIG,
    decode_groups: tuple[int, ...] | None = DEFAULT_DECODE_GROUPS,
) -> ServingEngine:
    """The host's engine over `model` with `config`, its GPU sharing (`host_sharing`) and its
    decode graphs per split; with `memory_pool`, its KV cache in a unified pool of `pool_bytes`
    (CUDA: None takes the free device memory less decode's room) under `memory_config`, the
    engine built from the pool's `EngineConfig`. `lora`: the engine's LoRA runtime, built before
    the pool (its slots are decode's memory). A failure after the pool exists releases it."""
    sharing = host_sharing(str(config.device), decode_groups)
    if not memory_pool:
        engine = Engine(model, config, tokenizer=tokenizer, lora=lora)
        capture_decode_graphs(engine, sharing)
        return ServingEngine(engine, None, sharing)
    memory = build_host_memory(model, config, pool_bytes=pool_bytes, config=memory_config)
    try:
        engine = Engine(
            model,
            memory.engine_config,
            tokenizer=tokenizer,
            lora=lora,
            kv_storage_factory=memory.storage_factory,
        )
        memory.attach(engine)
        capture_decode_graphs(engine, sharing)  # graphs bake in KV addresses; the range stays
        memory.decode_ready()
    except Exception:
        memory.close()
        raise
    return ServingEngine(engine, memory, sharing)


def build_host_loop(
    serving: ServingEngine,
    policy: CoLocationPolicy,
    *,
    tpot_slo_ms: float,
    metrics_sink: Callable[[IterationRecord], None] | None = None,
    output_sink: Callable[[list[RequestOutput]], None] | None = None,
    executor: QuantumExecutor | None = None,
    launch_during_decode: bool = LAUNCH_DURING_DECODE,
) -> HostLoop:
    """The co-location loop over `serving` with `policy`: decode on the engine's SM splits,
    quanta borrowing from its pool when it has one (each launch's activation recomputation
    chosen from the budget, graph shapes pooled per launch and released between quanta when
    decode grows), the pool bound to the loop. `executor` (default: the loop's own) and
    `launch_during_decode` are the loop's (`HostLoop`)."""
    memory = serving.memory
    loop = HostLoop(
        serving.engine,
        policy,
        tpot_slo_ms=tpot_slo_ms,
        metrics_sink=metrics_sink,
        output_sink=output_sink,
        memory=memory.memory if memory is not None else None,
        sharing=serving.sharing,
        executor=executor,
        choose_recompute=True,  # quanta fit the pool's budget by recomputing when they must
        release_graph_shapes=memory is not None,
        launch_during_decode=launch_during_decode,
    )
    if memory is not None:
        memory.bind_loop(loop)
    return loop
