"""What a host reports besides job events: its heartbeat snapshot (with the serving figures
the gateway routes by) and the interval metrics, each with its per-engine-group and per-GPU
entries (`gpu_runtime.contract.engine_group_reports`). An agent drives one engine group (index
0) on GPUs 0 .. tensor_parallel_size - 1. Its memory figures are measured on rank 0's GPU; every
rank holds the same shard and the same KV blocks (rank 0's engine config sizes them; the unified
pool is refused above one GPU), so each GPU entry carries rank 0's figures and the group's (and
the host's) are their sum over the group's GPUs.

Pure functions over the engine and the co-location loop's aggregated interval; the runtime
calls them on the loop thread and hands the results to the report sender.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpu_runtime.agent.predictor import HarvestEstimate, PredictorInfo
from gpu_runtime.colocation import IntervalMetrics, TpotWindow
from gpu_runtime.contract.host_capabilities import HARLI_ARCHITECTURES
from gpu_runtime.contract.statistics import percentile
from gpu_runtime.engine import Engine
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.server.metrics import RequestMetrics


@dataclass(frozen=True)
class ServingFigures:
    """What the gateway routes by: the heartbeat's `serving` (see
    `gpu_runtime.contract.protocol`), taken on the loop thread."""

    running: int
    """Requests in the scheduler's running batch."""
    waiting: int
    """Requests waiting for admission (preempted ones included)."""
    kv_free_pages: int
    """KV blocks no request holds: the storage's capacity less the used blocks (with the
    memory pool, blocks lent to finetune count as free: decode takes them back first)."""
    kv_total_pages: int
    """KV blocks the storage holds (the block manager's capacity)."""
    adapter_slots_used: int
    """GPU adapter slots that running requests hold (a new adapter can be loaded while fewer
    than all are)."""
    adapter_slots_total: int
    resident_adapters: tuple[str, ...]
    """Servable adapters in GPU slots now (a request for one loads nothing)."""
    tpot_p50_ms: float | None
    """Median TPOT of the decode iterations of the window (`TpotWindow`); None: none ran."""
    slo_attainment: float | None
    """The fraction of those iterations within the host's TPOT SLO; None: none ran."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"resident_adapters": list(self.resident_adapters)}


def serving_figures(
    engine: Engine, lora: MultiLoraRuntime, window: TpotWindow, now: float
) -> ServingFigures:
    """The serving figures now (`now` on the loop's clock); cheap enough for every turn."""
    scheduler = engine.scheduler
    blocks = engine.block_manager
    running = len(scheduler.running)
    tpot_p50_ms, attainment = window.figures(now)
    return ServingFigures(
        running=running,
        # every live request waits or runs (the waiting view would copy a long queue)
        waiting=len(scheduler.requests) - running,
        kv_free_pages=blocks.capacity - blocks.num_used_blocks,
        kv_total_pages=blocks.capacity,
        adapter_slots_used=lora.manager.held_slots(),
        adapter_slots_total=lora.weights.num_slots,
        resident_adapters=tuple(lora.manager.resident()),
        tpot_p50_ms=tpot_p50_ms,
        slo_attainment=attainment,
    )


@dataclass(frozen=True)
class HostSnapshot:
    """What a heartbeat reports (a copy taken on the loop thread)."""

    base_model: str
    placements: list[int]
    adapters: list[str]
    free_bytes: int
    total_bytes: int
    harvest: HarvestEstimate
    draining: bool
    serving: ServingFigures
    predictor: PredictorInfo | None = None
    tensor_parallel_size: int = 1
    """GPUs the agent's one engine group shards its model over."""
    engine: str = "harli"
    capabilities: dict[str, Any] | None = None
    """The heartbeat's `capabilities` (`gpu_runtime.contract.host_capabilities`); None: a
    Harli engine's, its adapter slots from `serving` (:func:`harli_capabilities`)."""
    engine_state: dict[str, Any] | None = None
    """The supervised server's `{"state", "restarts"}` (vLLM hosts); None: not reported."""

    def heartbeat_fields(self) -> dict[str, Any]:
        """The heartbeat report's fields (see `gpu_runtime.contract.protocol`)."""
        t = self.tensor_parallel_size
        gpus = [
            {"index": i, "total_bytes": self.total_bytes, "free_bytes": self.free_bytes}
            for i in range(t)
        ]
        group = {
            "index": 0,
            "deployment": None,
            "base_model": self.base_model,
            "tensor_parallel_size": t,
            "gpu_indices": list(range(t)),
            "total_bytes": self.total_bytes * t,
            "free_bytes": self.free_bytes * t,
            "free_bytes_per_gpu": self.free_bytes,
            "harvestable_tokens_per_s": self.harvest.tokens_per_s,
            "harvest": self.harvest.as_dict(),
            "placements": self.placements,
            "predictor_version": self.predictor.version if self.predictor else None,
        }
        return self._host_fields() | {"engine_groups": [group], "gpus": gpus}

    def _host_fields(self) -> dict[str, Any]:
        t = self.tensor_parallel_size
        return {
            "base_model": self.base_model,
            "draining": self.draining,
            "total_bytes": self.total_bytes * t,
            "free_bytes": self.free_bytes * t,
            "harvestable_tokens_per_s": self.harvest.tokens_per_s,
            "harvest": self.harvest.as_dict(),
            "placements": self.placements,
            "adapters": self.adapters,
            "predictor_version": self.predictor.version if self.predictor else None,
            "predictor_mape": self.predictor.mape if self.predictor else None,
            "serving": self.serving.as_dict(),
        } | self._engine_fields()

    def _engine_fields(self) -> dict[str, Any]:
        caps = self.capabilities
        if caps is None:
            caps = harli_capabilities(self.serving.adapter_slots_total, None)
        fields: dict[str, Any] = {"engine": self.engine, "capabilities": caps}
        if self.engine_state is not None:
            fields["engine_state"] = self.engine_state
        return fields


def harli_capabilities(max_loras: int, max_lora_rank: int | None) -> dict[str, Any]:
    """A Harli engine host's heartbeat `capabilities`: it co-locates finetuning and serves the
    architectures the engine implements (`max_lora_rank` left out when None)."""
    caps: dict[str, Any] = {
        "colocation": True,
        "architectures": list(HARLI_ARCHITECTURES),
        "max_loras": max_loras,
    }
    if max_lora_rank is not None:
        caps["max_lora_rank"] = max_lora_rank
    return caps


def weights_bytes(engine: Engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def kv_bytes_per_block(engine: Engine) -> int:
    """Bytes of K and V of every layer for one block of `block_size` tokens on this GPU (the
    rank's KV heads under tensor parallelism)."""
    config = engine.runner.model.local_config
    element = 2 if engine.config.device != "cpu" else 4
    return (
        engine.config.block_size
        * config.num_hidden_layers
        * 2
        * config.num_key_value_heads
        * config.head_dim
        * element
    )


def metrics_fields(
    *,
    window_s: float,
    host_metrics: dict[str, Any],
    deployment_metrics: dict[str, Any] | None,
    total_bytes: int,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """A metrics report's fields for an agent with one engine group: the host-level
    `host_metrics` and `deployment_metrics`, the same figures as group 0's entry, and per-GPU
    figures. `host_metrics`' memory and `total_bytes` are rank 0's GPU's (every rank holds the
    same); the group's and the host's memory figures are their sum over the group's GPUs."""
    t = tensor_parallel_size
    memory = ("kv_used_bytes", "finetune_lent_bytes", "free_bytes")
    per_gpu = {name: int(host_metrics[name]) for name in memory}
    gpus = [{"index": i, "total_bytes": total_bytes, **per_gpu} for i in range(t)]
    host_metrics = host_metrics | {name: per_gpu[name] * t for name in memory}
    group = {
        "index": 0,
        "deployment": None,
        "tensor_parallel_size": t,
        "gpu_indices": list(range(t)),
        **{name: per_gpu[name] * t for name in memory},
        "finetune_tokens_per_s": host_metrics.get("finetune_tokens_per_s", 0.0),
        "deployment_metrics": deployment_metrics,
        "gpus": gpus,
    }
    return {
        "window_s": window_s,
        "host_metrics": host_metrics,
        "deployment_metrics": deployment_metrics,
        "engine_groups": [group],
        "gpus": gpus,
    }


def deployment_metrics(
    interval: IntervalMetrics,
    requests: list[RequestMetrics],
    predictor: PredictorInfo | None,
    predicted_iter_ms: float | None,
    observed_iter_ms: float | None,
) -> dict[str, Any] | None:
    """The `deployment_metrics` of a metrics report, or None when no decode ran. TPOT comes
    from the loop's token timings; TTFT from the server's per-request records. The predicted
    and observed decode latencies are means over the iterations the policy predicted (without
    a prediction, observed is the mean iteration time)."""
    if interval.tpot_ms_p50 is None or interval.tpot_ms_p99 is None:
        return None
    iterations = max(interval.decode_iterations, 1)
    ttfts = [r.ttft_s * 1e3 for r in requests]
    return {
        "tpot_p50_ms": interval.tpot_ms_p50,
        "tpot_p99_ms": interval.tpot_ms_p99,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "slo_attainment": (
            interval.slo_attainment
            if interval.slo_attainment is not None
            else interval.token_slo_attainment or 0.0
        ),
        "goodput_tokens_per_s": interval.goodput_tokens_per_s,
        "request_rate": interval.finished_requests / max(interval.seconds, 1e-9),
        "observed_iter_ms": (
            observed_iter_ms
            if predicted_iter_ms is not None
            else interval.seconds * 1e3 / iterations
        ),
        "predicted_iter_ms": predicted_iter_ms,
        "predictor_version": predictor.version if predictor else None,
    }
