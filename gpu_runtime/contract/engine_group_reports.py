"""The per-engine-group and per-GPU parts of heartbeats and metrics reports.

A host drives one engine group per deployment it serves (a group runs one model sharded over
`tensor_parallel_size` of the host's GPUs). Its reports carry, beside the host-level fields
of `gpu_runtime.contract.protocol` (which stay: the sums over the host):

* `engine_groups`: one entry per group, `index` unique on the host (the control plane's
  `EngineGroup.index`), `tensor_parallel_size` equal to the length of `gpu_indices` (the host's
  GPUs it drives, rank order), `deployment` (its name, or null when the agent does not know it:
  the control plane goes by `index`), and by kind:
  * heartbeat: `base_model`, `total_bytes`, `free_bytes` (sums over its GPUs),
    `free_bytes_per_gpu` (the least free bytes of its GPUs: what a job sharded over them can
    take on each), `harvestable_tokens_per_s`, `harvest`, `placements`, `predictor_version`;
  * metrics: `kv_used_bytes`, `finetune_lent_bytes`, `free_bytes`, `finetune_tokens_per_s`
    (sums over its GPUs), `deployment_metrics` (the protocol's shape, or null when it decoded
    nothing), `gpus` (its GPUs' entries as below).
* `gpus`: one entry per GPU, `index`, `total_bytes`, `free_bytes` (heartbeat and metrics), and in
  metrics also `kv_used_bytes`, `finetune_lent_bytes`.

An agent that sends no `engine_groups` (one engine, the older shape) is read as one group,
index 0, on GPUs `0 .. tensor_parallel_size - 1` of its one deployment, its host-level figures
being the group's (:func:`report_engine_groups`). Malformed entries make the whole report
malformed (:func:`check_engine_group_fields`).
"""

from __future__ import annotations

from typing import Any

_GROUP_REQUIRED = {
    "heartbeat": ("index", "tensor_parallel_size", "gpu_indices", "free_bytes", "placements"),
    "metrics": ("index", "tensor_parallel_size", "gpu_indices", "free_bytes"),
}
_GPU_REQUIRED = ("index", "total_bytes", "free_bytes")


class EngineGroupReportError(ValueError):
    """An `engine_groups` or `gpus` entry that breaks the module's shape."""


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise EngineGroupReportError(f"{name} must be an integer >= 0, got {value!r:.80}")
    return value


def _check_gpus(gpus: Any, name: str) -> None:
    if not isinstance(gpus, list):
        raise EngineGroupReportError(f"{name} must be a list, got {type(gpus).__name__}")
    seen: set[int] = set()
    for i, gpu in enumerate(gpus):
        if not isinstance(gpu, dict):
            raise EngineGroupReportError(f"{name}[{i}] must be an object")
        missing = [f for f in _GPU_REQUIRED if f not in gpu]
        if missing:
            raise EngineGroupReportError(f"{name}[{i}] lacks {missing}")
        index = _count(gpu["index"], f"{name}[{i}].index")
        for field in ("total_bytes", "free_bytes", "kv_used_bytes", "finetune_lent_bytes"):
            if field in gpu:
                _count(gpu[field], f"{name}[{i}].{field}")
        if index in seen:
            raise EngineGroupReportError(f"{name} names GPU {index} twice")
        seen.add(index)


def check_engine_group_fields(kind: str, message: dict[str, Any]) -> None:
    """Raise EngineGroupReportError when a heartbeat's or metrics report's `engine_groups` or
    `gpus` (where present) break the module's shape: required fields, counts >= 0, unique group
    indices, `tensor_parallel_size == len(gpu_indices)`, no GPU in two groups."""
    if "gpus" in message:
        _check_gpus(message["gpus"], "gpus")
    if "engine_groups" not in message:
        return
    groups = message["engine_groups"]
    if not isinstance(groups, list) or not groups:
        raise EngineGroupReportError("engine_groups must be a non-empty list")
    indices: set[int] = set()
    held: dict[int, int] = {}
    for i, group in enumerate(groups):
        name = f"engine_groups[{i}]"
        if not isinstance(group, dict):
            raise EngineGroupReportError(f"{name} must be an object")
        missing = [f for f in _GROUP_REQUIRED[kind] if f not in group]
        if missing:
            raise EngineGroupReportError(f"{name} lacks {missing}")
        index = _count(group["index"], f"{name}.index")
        if index in indices:
            raise EngineGroupReportError(f"engine_groups names group {index} twice")
        indices.add(index)
        gpu_indices = group["gpu_indices"]
        if not isinstance(gpu_indices, list) or not gpu_indices:
            raise EngineGroupReportError(f"{name}.gpu_indices must be a non-empty list")
        size = _count(group["tensor_parallel_size"], f"{name}.tensor_parallel_size")
        if size != len(gpu_indices):
            raise EngineGroupReportError(
                f"{name}.tensor_parallel_size {size} != {len(gpu_indices)} gpu_indices"
            )
        for gpu in gpu_indices:
            _count(gpu, f"{name}.gpu_indices[]")
            if gpu in held:
                raise EngineGroupReportError(f"GPU {gpu} is in groups {held[gpu]} and {index}")
            held[gpu] = index
        _count(group["free_bytes"], f"{name}.free_bytes")
        if "gpus" in group:
            _check_gpus(group["gpus"], f"{name}.gpus")
        if kind == "heartbeat" and not isinstance(group["placements"], list):
            raise EngineGroupReportError(f"{name}.placements must be a list")


def report_engine_groups(
    kind: str, message: dict[str, Any], *, tensor_parallel_size: int = 1
) -> list[dict[str, Any]]:
    """The report's groups: its `engine_groups`, or, from an agent of the older shape, one
    group 0 built from its host-level fields on GPUs `0 .. tensor_parallel_size - 1` (the
    control plane passes its group 0's degree)."""
    if "engine_groups" in message:
        return list(message["engine_groups"])
    gpus = list(range(tensor_parallel_size))
    group: dict[str, Any] = {
        "index": 0,
        "deployment": None,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_indices": gpus,
    }
    if kind == "heartbeat":
        free = int(message.get("free_bytes", 0))
        group |= {
            "base_model": message.get("base_model", ""),
            "total_bytes": int(message.get("total_bytes", 0)),
            "free_bytes": free,
            "free_bytes_per_gpu": free // tensor_parallel_size,
            "harvestable_tokens_per_s": message.get("harvestable_tokens_per_s", 0.0),
            "harvest": message.get("harvest") or {},
            "placements": list(message.get("placements", [])),
            "predictor_version": message.get("predictor_version"),
        }
    else:
        host = dict(message.get("host_metrics") or {})
        group |= {
            "kv_used_bytes": host.get("kv_used_bytes", 0),
            "finetune_lent_bytes": host.get("finetune_lent_bytes", 0),
            "free_bytes": host.get("free_bytes", 0),
            "finetune_tokens_per_s": host.get("finetune_tokens_per_s", 0.0),
            "deployment_metrics": message.get("deployment_metrics"),
            "gpus": list(message.get("gpus", [])),
        }
    return [group]
