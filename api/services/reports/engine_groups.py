"""Reading a report's engine groups against the host's `EngineGroup` rows.

A report names groups by `index` (`gpu_runtime.contract.engine_group_reports`); one from an
agent of the one-engine shape is read as group 0 at the degree of the host's group 0. An entry
whose index the host has no group for is left out (the operator removed it, or the agent runs
ahead of the control plane); it is logged, not an error.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from api.models import EngineGroup, GpuHost
from gpu_runtime.contract.engine_group_reports import report_engine_groups

logger = logging.getLogger(__name__)


def host_engine_groups(host: GpuHost) -> dict[int, EngineGroup]:
    """The host's groups by index, with their deployments and base models (one query)."""
    rows = EngineGroup.objects.filter(host=host).select_related("deployment__base_model")
    return {g.index: g for g in rows}


def reported_groups(
    kind: str, host: GpuHost, message: dict[str, Any], groups: dict[int, EngineGroup]
) -> list[tuple[EngineGroup, dict[str, Any]]]:
    """`(group row, report entry)` for each entry of the report whose group the host has."""
    first = groups.get(0)
    size = first.tensor_parallel_size if first is not None else 1
    pairs = []
    for entry in report_engine_groups(kind, message, tensor_parallel_size=size):
        group = groups.get(int(entry["index"]))
        if group is None:
            logger.warning("host %s reported engine group %s, which it does not have",
                           host.name, entry["index"])  # fmt: skip
            continue
        pairs.append((group, entry))
    return pairs


def _number(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0


def agent_group_state(group: EngineGroup, entry: dict[str, Any]) -> dict[str, Any]:
    """What `HostAgentState.engine_groups` keeps of a heartbeat's group entry."""
    size = group.tensor_parallel_size
    free = int(entry.get("free_bytes", 0))
    per_gpu = entry.get("free_bytes_per_gpu")
    return {
        "index": group.index,
        "base_model": str(entry.get("base_model") or ""),
        "tensor_parallel_size": int(entry.get("tensor_parallel_size", size)),
        "gpu_indices": [int(g) for g in entry.get("gpu_indices", group.gpu_indices)],
        "free_bytes": free,
        "free_bytes_per_gpu": int(per_gpu) if isinstance(per_gpu, int) else free // size,
        "harvestable_tokens_per_s": _number(entry.get("harvestable_tokens_per_s")),
        "harvest": dict(entry.get("harvest") or {}),
        "placements": [int(p) for p in entry.get("placements", [])],
        "predictor_version": entry.get("predictor_version"),
    }


def gpu_figures(gpus: Any) -> list[dict[str, int]]:
    """A report's `gpus` entries as stored (already checked by the contract), by GPU index."""
    if not isinstance(gpus, list):
        return []
    keep = ("index", "total_bytes", "free_bytes", "kv_used_bytes", "finetune_lent_bytes")
    rows = [{k: int(g[k]) for k in keep if k in g} for g in gpus if isinstance(g, dict)]
    return sorted(rows, key=lambda g: g["index"])
