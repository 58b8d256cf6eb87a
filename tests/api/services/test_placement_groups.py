"""Placement on engine groups: a job goes to a group serving its base model, its memory is
counted per GPU of the group at the group's degree, the group's own harvest estimate decides,
and the placement (and its `apply_placement`) names the group."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import BaseModel, Deployment, FinetuneJob, GpuHost
from api.presets import PRESETS
from api.services.engine_groups import engine_group_add
from api.services.fleet import deployment_create, host_register
from api.services.placement import finetune_memory_estimate
from tests.api.services.conftest import GIB, drain_host_queue, heartbeat, place_now

pytestmark = pytest.mark.django_db


@pytest.fixture
def wide_job(job: FinetuneJob, tiny: BaseModel) -> FinetuneJob:
    """`job`, its base model given Llama-3-8B's shape (the estimate then exceeds the minimum
    charge, so sharding shows; the tiny tokenizer stays)."""
    BaseModel.objects.filter(pk=tiny.pk).update(config=dict(PRESETS["llama3-8b"].config))
    return FinetuneJob.objects.select_related("base_model").get(pk=job.pk)


def tp2(tiny: BaseModel) -> Deployment:
    return deployment_create(name="tiny-tp2", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500,
                             tensor_parallel_size=2)  # fmt: skip


def group_entry(index: int, gpus: list[int], free_per_gpu: int, harvest: float) -> dict[str, Any]:
    return {
        "index": index,
        "deployment": "tiny-tp2",
        "base_model": "tiny",
        "tensor_parallel_size": len(gpus),
        "gpu_indices": gpus,
        "total_bytes": len(gpus) * 16 * GIB,
        "free_bytes": len(gpus) * free_per_gpu,
        "free_bytes_per_gpu": free_per_gpu,
        "harvestable_tokens_per_s": harvest,
        "harvest": {"source": "predictor", "tensor_parallel_size": len(gpus)},
        "placements": [],
        "predictor_version": f"tp{len(gpus)}-v1",
    }


def four_gpu_host(deployment: Deployment) -> GpuHost:
    host = host_register(name="h1", gpu_kind="cpu", gpu_memory_bytes=16 * GIB, gpu_count=4,
                         deployment=deployment)  # fmt: skip
    engine_group_add(host=host, deployment=deployment)
    return host


def test_memory_is_counted_per_gpu_at_the_groups_degree(
    wide_job: FinetuneJob, tiny: BaseModel, django_capture_on_commit_callbacks: Any
) -> None:
    whole = finetune_memory_estimate(job=wide_job)
    per_gpu = finetune_memory_estimate(job=wide_job, tensor_parallel_size=2)
    assert per_gpu < whole  # the sharded parts halve; replicated LoRA A/B halves do not
    four_gpu_host(tp2(tiny))
    # group 0 lacks one byte per GPU; group 1 has exactly the per-GPU need, less than `whole`
    heartbeat("h1", free_bytes=2 * per_gpu, engine_groups=[
        group_entry(0, [0, 1], per_gpu - 1, 900.0), group_entry(1, [2, 3], per_gpu, 100.0)
    ])  # fmt: skip
    placement = place_now(wide_job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.engine_group is not None
    assert (placement.host.name, placement.engine_group.index) == ("h1", 1)
    reasons = placement.decision.reasons
    assert (reasons["chosen_engine_group"], reasons["tensor_parallel_size"]) == (1, 2)
    assert reasons["needed_bytes_per_gpu"] == per_gpu
    rows = {r["engine_group"]: r for r in reasons["candidates"]}
    assert rows[0]["why"] == f"free {per_gpu - 1} B < needed {per_gpu} B on each of GPUs 0-1"
    assert (rows[1]["eligible"], rows[1]["headroom_bytes"]) == (True, 0)
    assert rows[1]["predictor_version"] == "tp2-v1"
    (command,) = drain_host_queue("h1")
    assert (command["command"], command["engine_group"]) == ("apply_placement", 1)
    event = wide_job.events.get(message="Placed for training")
    assert dict(event.fleet_detail or {})["text"] == "Placed on host h1, engine group 1 (GPUs 2-3)"


def test_the_groups_own_harvest_share_decides(
    wide_job: FinetuneJob, tiny: BaseModel, django_capture_on_commit_callbacks: Any
) -> None:
    four_gpu_host(tp2(tiny))
    heartbeat("h1", engine_groups=[
        group_entry(0, [0, 1], 8 * GIB, 100.0), group_entry(1, [2, 3], 4 * GIB, 500.0)
    ])  # fmt: skip
    first = place_now(wide_job, django_capture_on_commit_callbacks)
    assert first is not None and first.engine_group is not None
    assert first.engine_group.index == 1  # 500 tokens/s beats 100 despite less headroom


def test_a_single_gpu_group_is_not_charged_the_sharded_figure(
    wide_job: FinetuneJob, deployment: Deployment, django_capture_on_commit_callbacks: Any
) -> None:
    per_gpu_at_2 = finetune_memory_estimate(job=wide_job, tensor_parallel_size=2)
    host_register(name="h1", gpu_kind="cpu", gpu_memory_bytes=16 * GIB, deployment=deployment)
    heartbeat("h1", free_bytes=per_gpu_at_2)  # the one-engine shape: group 0 at TP 1
    assert place_now(wide_job, django_capture_on_commit_callbacks) is None
    heartbeat("h1", free_bytes=finetune_memory_estimate(job=wide_job))
    placement = place_now(wide_job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.engine_group is not None
    assert placement.engine_group.index == 0
    (command,) = drain_host_queue("h1")
    assert "engine_group" not in command  # group 0: what a one-engine agent trains on


def test_a_group_its_agent_runs_at_another_degree_gets_no_job(
    wide_job: FinetuneJob, tiny: BaseModel, django_capture_on_commit_callbacks: Any
) -> None:
    four_gpu_host(tp2(tiny))
    one_gpu = group_entry(0, [0], 8 * GIB, 900.0)  # an agent serving group 0 on one GPU
    heartbeat("h1", engine_groups=[one_gpu])
    assert place_now(wide_job, django_capture_on_commit_callbacks) is None
    event = wide_job.events.order_by("-id").first()
    assert event is not None
    assert "engine group 0 runs at tensor_parallel_size 1, its deployment asks 2" in str(
        event.fleet_detail
    )
