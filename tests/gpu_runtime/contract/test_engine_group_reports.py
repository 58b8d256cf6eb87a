"""The per-engine-group and per-GPU report shape: what an agent with one engine group sends
(`gpu_runtime.agent.reporting`) passes the contract, the one-engine shape reads as group 0,
and entries that break the shape make the report malformed."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_runtime.agent.predictor import HarvestEstimate
from gpu_runtime.agent.reporting import HostSnapshot, ServingFigures, metrics_fields
from gpu_runtime.contract.engine_group_reports import report_engine_groups
from gpu_runtime.contract.protocol import ProtocolError, check_report, report

GIB = 2**30
SERVING = ServingFigures(running=1, waiting=0, kv_free_pages=10, kv_total_pages=20,
                         adapter_slots_used=0, adapter_slots_total=4, resident_adapters=(),
                         tpot_p50_ms=None, slo_attainment=None)  # fmt: skip
HOST_METRICS = {"weights_bytes": 8 * GIB, "kv_used_bytes": 4 * GIB,
                "finetune_lent_bytes": 2 * GIB, "free_bytes": 6 * GIB,
                "finetune_tokens_per_s": 300.0}  # fmt: skip


@pytest.mark.parametrize("size", [1, 2])
def test_the_agents_heartbeat_carries_its_one_group(size: int) -> None:
    snapshot = HostSnapshot(base_model="tiny", placements=[7], adapters=[], free_bytes=6 * GIB,
                            total_bytes=20 * GIB, draining=False, serving=SERVING,
                            harvest=HarvestEstimate(tokens_per_s=250.0, source="measured"),
                            tensor_parallel_size=size)  # fmt: skip
    message = report("heartbeat", "h1", **snapshot.heartbeat_fields())
    (group,) = message["engine_groups"]
    assert (group["index"], group["gpu_indices"], group["placements"]) == (
        0, list(range(size)), [7]
    )  # fmt: skip
    # rank 0's GPU's figures, mirrored on every rank; the group's are their sum
    assert group["free_bytes_per_gpu"] == 6 * GIB
    assert (group["free_bytes"], group["total_bytes"]) == (6 * GIB * size, 20 * GIB * size)
    assert [g["index"] for g in message["gpus"]] == list(range(size))
    assert [g["free_bytes"] for g in message["gpus"]] == [6 * GIB] * size
    assert message["free_bytes"] == 6 * GIB * size and message["harvestable_tokens_per_s"] == 250.0


def test_the_agents_metrics_name_group_0_and_its_gpus() -> None:
    fields = metrics_fields(window_s=5.0, host_metrics=HOST_METRICS, deployment_metrics=None,
                            total_bytes=20 * GIB, tensor_parallel_size=2)  # fmt: skip
    message = report("metrics", "h1", **fields)
    (group,) = message["engine_groups"]
    assert (group["free_bytes"], group["deployment_metrics"]) == (12 * GIB, None)
    assert message["host_metrics"]["kv_used_bytes"] == 8 * GIB
    assert message["gpus"] == [
        {"index": 0, "total_bytes": 20 * GIB, "kv_used_bytes": 4 * GIB,
         "finetune_lent_bytes": 2 * GIB, "free_bytes": 6 * GIB},
        {"index": 1, "total_bytes": 20 * GIB, "kv_used_bytes": 4 * GIB,
         "finetune_lent_bytes": 2 * GIB, "free_bytes": 6 * GIB},
    ]  # fmt: skip


def test_the_one_engine_shape_reads_as_group_0() -> None:
    heartbeat: dict[str, Any] = {"free_bytes": 8 * GIB, "total_bytes": 16 * GIB,
                                 "placements": [3], "harvestable_tokens_per_s": 9.0,
                                 "base_model": "tiny"}  # fmt: skip
    (group,) = report_engine_groups("heartbeat", heartbeat, tensor_parallel_size=4)
    assert (group["index"], group["gpu_indices"], group["free_bytes_per_gpu"]) == (
        0, [0, 1, 2, 3], 2 * GIB
    )  # fmt: skip
    assert (group["placements"], group["harvestable_tokens_per_s"]) == ([3], 9.0)
    metrics = {"host_metrics": HOST_METRICS, "deployment_metrics": {"tpot_p50_ms": 1.0}}
    (entry,) = report_engine_groups("metrics", metrics)
    assert (entry["finetune_tokens_per_s"], entry["deployment_metrics"]) == (
        300.0, {"tpot_p50_ms": 1.0}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("groups", "error"),
    [
        ([], "engine_groups must be a non-empty list"),
        ([{"index": 0, "tensor_parallel_size": 1, "gpu_indices": [0]}], "lacks ['free_bytes']"),
        ([{"index": 0, "tensor_parallel_size": 2, "gpu_indices": [0], "free_bytes": 0}],
         "tensor_parallel_size 2 != 1 gpu_indices"),
        ([{"index": 0, "tensor_parallel_size": 1, "gpu_indices": [1], "free_bytes": 0},
          {"index": 1, "tensor_parallel_size": 1, "gpu_indices": [1], "free_bytes": 0}],
         "GPU 1 is in groups 0 and 1"),
        ([{"index": 0, "tensor_parallel_size": 1, "gpu_indices": [0], "free_bytes": 0,
           "gpus": [{"index": 0, "total_bytes": 1}]}], "engine_groups[0].gpus[0] lacks"),
    ],
)  # fmt: skip
def test_entries_that_break_the_shape_are_malformed(groups: list[Any], error: str) -> None:
    message = {"message_id": "m1", "kind": "metrics", "host": "h1", "sent_at": 0.0,
               "host_metrics": HOST_METRICS, "engine_groups": groups}  # fmt: skip
    with pytest.raises(ProtocolError) as raised:
        check_report(message)
    assert error in str(raised.value)
