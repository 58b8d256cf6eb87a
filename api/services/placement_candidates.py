"""Placement's candidates: the engine groups of the fleet, each one's row for a job, the
job's per-GPU memory estimate at a group's degree, and the choice among eligible rows (the rule
is `api.services.placement`'s module docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.models import (
    EngineGroup,
    FinetuneJob,
    GpuHost,
    HostAgentState,
    HostStatus,
    JobMethod,
)
from gpu_runtime.contract.footprint import MIN_FINETUNE_BYTES, finetune_footprint_bytes
from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.tensor_parallel import TensorParallelError
from gpu_runtime.contract.training_data import training_max_seq_len

THROUGHPUT_TOLERANCE = 0.1
"""Throughput shares within this fraction of the best count as equal (headroom decides)."""
POLICY = (
    f"engine group's harvestable tokens/s / (1 + its open placements), within "
    f"{THROUGHPUT_TOLERANCE:.0%} of the best; then the most per-GPU memory headroom after the "
    "job; then the host's name and the group's index"
)


def finetune_memory_estimate(*, job: FinetuneJob, tensor_parallel_size: int = 1) -> int:
    """Bytes a job borrows on each GPU of an engine group of `tensor_parallel_size`
    (`gpu_runtime.contract.footprint`; the whole job at 1).

    Uses the base model's config (preset models); a checkpoint-dir model without a stored
    config is charged :data:`MIN_FINETUNE_BYTES`. Sequences count at min(context, 2048); a
    DPO example is two of them (its preferred and other output).
    """
    if not job.base_model.config:
        return MIN_FINETUNE_BYTES
    batch = job.hyperparameters.get("batch_size")
    micro_batch = batch if isinstance(batch, int) else 1
    rows = 2 if job.method == JobMethod.DPO else 1
    return finetune_footprint_bytes(
        ModelConfig.from_hf_config(job.base_model.config),
        rank=job.lora_rank,
        target_modules=list(job.lora_target_modules),
        tokens=rows * micro_batch * training_max_seq_len(job.base_model.context_length),
        tensor_parallel_size=tensor_parallel_size,
    )


@dataclass
class Slot:
    """A candidate of the pass: an engine group of a host, or a host without any (`group`
    None: it serves nothing)."""

    host: GpuHost
    group: EngineGroup | None

    @property
    def size(self) -> int:
        return self.group.tensor_parallel_size if self.group is not None else 1


def slots_of(hosts: list[GpuHost], groups: list[EngineGroup]) -> list[Slot]:
    by_host: dict[int, list[EngineGroup]] = {}
    for group in groups:
        by_host.setdefault(group.host_id, []).append(group)
    slots: list[Slot] = []
    for host in hosts:
        mine = by_host.get(host.pk, [])
        slots += [Slot(host, g) for g in mine] if mine else [Slot(host, None)]
    return slots


def reported_group(state: HostAgentState | None, group: EngineGroup) -> dict[str, Any] | None:
    """The group's entry of the host's last heartbeat (`HostAgentState.engine_groups`)."""
    if state is None:
        return None
    return next((g for g in state.engine_groups or [] if g.get("index") == group.index), None)


def candidate_row(
    slot: Slot,
    job: FinetuneJob,
    need: int,
    fresh_after: Any,
    load: dict[int, int],
    free: dict[int, int],
) -> dict[str, Any]:
    """One group's row for `job`: `need` is the job's per-GPU estimate at the group's degree,
    `free` the per-GPU free bytes its heartbeat reported less the estimates of the jobs this
    pass placed on it."""
    host, group = slot.host, slot.group
    state: HostAgentState | None = getattr(host, "agent_state", None)
    entry = reported_group(state, group) if group is not None else None
    free_bytes = free.get(group.pk, 0) if group is not None else 0
    row: dict[str, Any] = {
        "host": host.name,
        "engine_group": group.index if group is not None else None,
        "deployment": group.deployment.name if group is not None else None,
        "tensor_parallel_size": slot.size,
        "gpu_indices": group.gpu_indices if group is not None else [],
        "gpu_memory_bytes": host.gpu_memory_bytes,
        "status": host.status,
        "free_bytes_per_gpu": free_bytes if entry else None,
        "needed_bytes_per_gpu": need,
        "harvestable_tokens_per_s": entry.get("harvestable_tokens_per_s") if entry else None,
        "harvest": dict(entry.get("harvest") or {}) if entry else None,
        "predictor_version": (entry or {}).get("predictor_version") or host.predictor_version,
        "open_placements": load.get(group.pk, 0) if group is not None else 0,
        "eligible": False,
    }
    if host.status != HostStatus.ONLINE:
        row["why"] = f"host is {host.status}"
    elif group is None or group.deployment.base_model_id != job.base_model_id:
        row["why"] = f"does not serve {job.base_model.name}"
    elif state is None or state.reported_at is None or state.reported_at < fresh_after:
        row["why"] = "no recent heartbeat"
    elif state.draining:
        row["why"] = "agent is draining"
    elif not (state.capabilities or {}).get("colocation", True):
        row["why"] = f"host cannot train (engine {state.engine})"
    elif entry is None:
        row["why"] = f"engine group {group.index} not in the host's last heartbeat"
    elif int(entry.get("tensor_parallel_size", slot.size)) != slot.size:
        row["why"] = (
            f"engine group {group.index} runs at tensor_parallel_size "
            f"{entry.get('tensor_parallel_size')}, its deployment asks {slot.size}"
        )
    elif free_bytes < need:
        row["why"] = f"free {free_bytes} B < needed {need} B"
        if slot.size > 1:
            row["why"] += f" on each of {group.gpu_range}"
    else:
        row["eligible"] = True
        row["score"] = float(row["harvestable_tokens_per_s"] or 0.0) / (1 + row["open_placements"])
        row["headroom_bytes"] = free_bytes - need
        row["why"] = "eligible"
    return row


def choose(eligible: list[dict[str, Any]]) -> dict[str, Any]:
    """The module docstring's rule; marks each row's `throughput_tier` ("best" or "below")."""
    top = max(r["score"] for r in eligible)
    for row in eligible:
        row["throughput_tier"] = (
            "best" if row["score"] >= top * (1 - THROUGHPUT_TOLERANCE) else "below"
        )
    best_tier = [r for r in eligible if r["throughput_tier"] == "best"]
    return min(best_tier, key=lambda r: (-r["headroom_bytes"], r["host"], r["engine_group"]))


def estimate_at(job: FinetuneJob, size: int) -> int:
    """The job's per-GPU estimate at degree `size`; a degree its shape does not allow (a
    group whose deployment is of another base model) is charged as unsharded."""
    try:
        return finetune_memory_estimate(job=job, tensor_parallel_size=size)
    except TensorParallelError:
        return finetune_memory_estimate(job=job)


def estimate_key(job: FinetuneJob) -> tuple[Any, ...]:
    """What :func:`finetune_memory_estimate` reads of a job."""
    batch = job.hyperparameters.get("batch_size")
    return (job.base_model_id, batch, job.method, job.lora_rank, tuple(job.lora_target_modules))
