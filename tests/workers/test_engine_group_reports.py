"""Report intake of engine groups (`workers.host_report`, signed as a host sends them): the
per-group and per-GPU shape is stored by group; the one-engine shape (and what the agent's
report builder sends) is read as group 0; malformed group entries drop the whole report."""

from __future__ import annotations

import time
from typing import Any

import pytest

from api.models import (
    BaseModel,
    DeploymentMetric,
    EngineGroup,
    EngineGroupMetric,
    GpuHost,
    HostAgentState,
    HostMetric,
    MetricRollup,
    ProcessedReport,
)
from api.services.engine_groups import engine_group_add
from api.services.fleet import base_model_register, deployment_create, host_register
from gpu_runtime.agent.reporting import metrics_fields
from gpu_runtime.contract.message_auth import message_sign
from gpu_runtime.contract.protocol import new_message_id
from tests.api.services.conftest import drain_host_queue
from workers.message_keys import host_message_key
from workers.tasks import host_report

pytestmark = pytest.mark.django_db
GIB = 2**30
HOST_METRICS = {"weights_bytes": 16 * GIB, "kv_used_bytes": 40 * GIB,
                "finetune_lent_bytes": 20 * GIB, "free_bytes": 60 * GIB,
                "finetune_tokens_per_s": 700.0}  # fmt: skip
DECODE = {"tpot_p50_ms": 20.0, "tpot_p99_ms": 40.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0,
          "slo_attainment": 0.99, "goodput_tokens_per_s": 900.0, "request_rate": 3.0,
          "predicted_iter_ms": 19.0, "observed_iter_ms": 20.0,
          "predictor_version": "tp2-v1"}  # fmt: skip


def _send(kind: str, **fields: Any) -> str:
    message = {"message_id": new_message_id(), "kind": kind, "host": "big",
               "sent_at": time.time(), **fields}  # fmt: skip
    return str(host_report(message_sign(message, host_message_key("big"))))


@pytest.fixture
def big(tiny: BaseModel) -> GpuHost:
    """Host `big`, 4 GPUs: group 0 serves tiny at TP 2 on GPUs 0-1, group 1 another model's
    deployment at TP 2 on GPUs 2-3."""
    other = base_model_register(name="other", preset="tiny")
    tp2 = deployment_create(name="tiny-tp2", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500,
                            tensor_parallel_size=2)  # fmt: skip
    other_tp2 = deployment_create(name="other-tp2", base_model=other, tpot_slo_ms=50,
                                  ttft_slo_ms=500, tensor_parallel_size=2)  # fmt: skip
    host = host_register(name="big", gpu_kind="H200", gpu_memory_bytes=141 * GIB, gpu_count=4,
                         deployment=tp2)  # fmt: skip
    engine_group_add(host=host, deployment=other_tp2)
    drain_host_queue("big")
    return host


def _gpu(index: int, free: int) -> dict[str, int]:
    return {"index": index, "total_bytes": 141 * GIB, "free_bytes": free,
            "kv_used_bytes": 10 * GIB, "finetune_lent_bytes": 5 * GIB}  # fmt: skip


def _metrics_group(index: int, gpus: list[int], decode: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "deployment": None, "tensor_parallel_size": len(gpus),
            "gpu_indices": gpus, "kv_used_bytes": 20 * GIB, "finetune_lent_bytes": 10 * GIB,
            "free_bytes": 30 * GIB, "finetune_tokens_per_s": 350.0 + index,
            "deployment_metrics": decode,
            "gpus": [_gpu(g, 15 * GIB) for g in gpus]}  # fmt: skip


def test_per_group_metrics_are_stored_by_group(big: GpuHost) -> None:
    groups = {g.index: g for g in EngineGroup.objects.filter(host=big)}
    assert _send("metrics", window_s=5.0, host_metrics=HOST_METRICS, deployment_metrics=DECODE,
                 gpus=[_gpu(g, (10 + g) * GIB) for g in range(4)],
                 engine_groups=[_metrics_group(0, [0, 1], DECODE),
                                _metrics_group(1, [2, 3], None)]) == "applied"  # fmt: skip
    host_row = HostMetric.objects.get(host=big)
    assert [(g["index"], g["free_bytes"]) for g in host_row.gpus] == [
        (0, 10 * GIB), (1, 11 * GIB), (2, 12 * GIB), (3, 13 * GIB)
    ]  # fmt: skip
    rows = {
        m.engine_group.index: m for m in EngineGroupMetric.objects.select_related("engine_group")
    }
    assert sorted(rows) == [0, 1]
    assert (rows[1].finetune_tokens_per_s, [g["index"] for g in rows[1].gpus]) == (351.0, [2, 3])
    (decode,) = DeploymentMetric.objects.all()  # group 1 decoded nothing
    assert (decode.engine_group_id, decode.deployment.name) == (groups[0].pk, "tiny-tp2")
    assert MetricRollup.objects.filter(series="deployment", key="tiny-tp2@big").exists()


def test_a_one_engine_report_is_its_hosts_group_0(big: GpuHost) -> None:
    assert _send("metrics", window_s=5.0, host_metrics=HOST_METRICS,
                 deployment_metrics=DECODE) == "applied"  # fmt: skip
    (row,) = EngineGroupMetric.objects.all()
    assert (row.engine_group.index, row.free_bytes, row.finetune_tokens_per_s) == (
        0, 60 * GIB, 700.0
    )  # fmt: skip
    assert DeploymentMetric.objects.get().engine_group == row.engine_group
    assert _send("heartbeat", base_model="tiny", free_bytes=60 * GIB, total_bytes=282 * GIB,
                 harvestable_tokens_per_s=80.0, placements=[]) == "applied"  # fmt: skip
    (entry,) = HostAgentState.objects.get(host=big).engine_groups
    assert (entry["index"], entry["gpu_indices"], entry["free_bytes_per_gpu"]) == (
        0, [0, 1], 30 * GIB
    )  # fmt: skip
    assert entry["harvestable_tokens_per_s"] == 80.0


def test_what_the_agents_report_builder_sends_is_ingested(big: GpuHost) -> None:
    # the agent's figures are rank 0's GPU's; every rank holds the same, the group the sum
    fields = metrics_fields(window_s=5.0, host_metrics=HOST_METRICS, deployment_metrics=DECODE,
                            total_bytes=141 * GIB, tensor_parallel_size=2)  # fmt: skip
    assert _send("metrics", **fields) == "applied"
    (row,) = EngineGroupMetric.objects.all()
    assert row.engine_group.index == 0
    assert [(g["index"], g["free_bytes"], g["total_bytes"]) for g in row.gpus] == [
        (0, 60 * GIB, 141 * GIB), (1, 60 * GIB, 141 * GIB)
    ]  # fmt: skip


def test_each_group_is_brought_to_its_deployments_base_model(
    big: GpuHost, django_capture_on_commit_callbacks: Any
) -> None:
    heartbeat_group = {"tensor_parallel_size": 2, "free_bytes": 4 * GIB,
                       "free_bytes_per_gpu": 2 * GIB, "placements": []}  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        sent = _send("heartbeat", base_model="tiny", free_bytes=8 * GIB, total_bytes=564 * GIB,
                 placements=[], gpus=[{"index": g, "total_bytes": 141 * GIB,
                                       "free_bytes": 2 * GIB} for g in range(4)],
                 engine_groups=[{"index": 0, "gpu_indices": [0, 1], "base_model": "tiny",
                                 **heartbeat_group},
                                {"index": 1, "gpu_indices": [2, 3], "base_model": "tiny",
                                 **heartbeat_group},
                                {"index": 7, "gpu_indices": [4, 5], "base_model": "tiny",
                                 **heartbeat_group}])  # fmt: skip
    assert sent == "applied"
    state = HostAgentState.objects.get(host=big)
    assert [e["index"] for e in state.engine_groups] == [0, 1]  # the host has no group 7
    assert [g["index"] for g in state.gpus] == [0, 1, 2, 3]
    loads = [c for c in drain_host_queue("big") if c["command"] == "load_base_model"]
    assert [(c["base_model"], c.get("engine_group")) for c in loads] == [("other", 1)]


BAD_GROUPS = {
    "degree and GPUs disagree": [{"index": 0, "tensor_parallel_size": 2, "gpu_indices": [0],
                                  "free_bytes": 1}],
    "one GPU in two groups": [{"index": 0, "tensor_parallel_size": 1, "gpu_indices": [0],
                               "free_bytes": 1},
                              {"index": 1, "tensor_parallel_size": 1, "gpu_indices": [0],
                               "free_bytes": 1}],
    "an index twice": [{"index": 0, "tensor_parallel_size": 1, "gpu_indices": [0],
                        "free_bytes": 1},
                       {"index": 0, "tensor_parallel_size": 1, "gpu_indices": [1],
                        "free_bytes": 1}],
    "a negative free figure": [{"index": 0, "tensor_parallel_size": 1, "gpu_indices": [0],
                                "free_bytes": -1}],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_GROUPS))
def test_malformed_group_entries_drop_the_report(big: GpuHost, case: str) -> None:
    message_id = new_message_id()
    message = {"message_id": message_id, "kind": "metrics", "host": "big",
               "sent_at": time.time(), "window_s": 5.0, "host_metrics": HOST_METRICS,
               "engine_groups": BAD_GROUPS[case]}  # fmt: skip
    assert host_report(message_sign(message, host_message_key("big"))) == "malformed"
    assert not HostMetric.objects.exists() and not EngineGroupMetric.objects.exists()
    assert not ProcessedReport.objects.filter(message_id=message_id).exists()
