"""`/api/ops/`: tensor-parallel deployments and a host's engine groups, driven as an operator's
client does: create a deployment at a degree, register a host, add, list and remove groups."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import Deployment, EngineGroup, File, Tenant
from api.services.jobs import finetune_job_create
from api.services.placement import job_place
from tests.api.conftest import ApiClient, assert_error
from tests.api.services.conftest import heartbeat

pytestmark = pytest.mark.django_db
GIB = 2**30


def _deployment(ops: ApiClient, name: str, size: int) -> Any:
    return ops.post("/api/ops/deployments", {"name": name, "base_model": "tiny",
                                             "tpot_slo_ms": 50, "ttft_slo_ms": 500,
                                             "tensor_parallel_size": size})  # fmt: skip


@pytest.fixture
def fleet(ops: ApiClient) -> None:
    assert ops.post("/api/ops/basemodels", {"name": "tiny", "preset": "tiny"}).status_code == 201
    assert _deployment(ops, "tiny-tp2", 2).json()["tensor_parallel_size"] == 2
    assert _deployment(ops, "tiny-tp1", 1).status_code == 201
    host = ops.post("/api/ops/hosts", {"name": "big", "gpu_kind": "H200", "gpu_count": 4,
                                       "gpu_memory_bytes": 141 * GIB,
                                       "deployment": "tiny-tp2"})  # fmt: skip
    assert host.status_code == 201, host.content


def test_a_degree_the_shape_does_not_allow_is_a_400_naming_it(ops: ApiClient) -> None:
    assert ops.post("/api/ops/basemodels", {"name": "tiny", "preset": "tiny"}).status_code == 201
    error = assert_error(_deployment(ops, "tiny-tp3", 3), 400)
    assert error["param"] == "tensor_parallel_size"
    assert "num_attention_heads 4 is not divisible by tensor_parallel_size 3" in error["message"]
    assert not Deployment.objects.exists()
    assert _deployment(ops, "tiny-tp4", 4).status_code == 201
    (listed,) = ops.get("/api/ops/deployments").json()["data"]
    assert (listed["name"], listed["tensor_parallel_size"]) == ("tiny-tp4", 4)
    assert ops.get("/api/ops/deployments/tiny-tp4").json()["tensor_parallel_size"] == 4


def test_groups_are_added_listed_and_removed(ops: ApiClient, fleet: None) -> None:
    added = ops.post("/api/ops/hosts/big/engine_groups", {"deployment": "tiny-tp1"})
    assert added.status_code == 201, added.content
    assert added.json() | {"created_at": None} == {
        "host": "big", "index": 1, "deployment": "tiny-tp1", "tensor_parallel_size": 1,
        "first_gpu": 2, "gpu_indices": [2], "created_at": None,
    }  # fmt: skip
    overlap = ops.post("/api/ops/hosts/big/engine_groups",
                       {"deployment": "tiny-tp2", "first_gpu": 1})  # fmt: skip
    error = assert_error(overlap, 409)
    assert (error["code"], error["message"]) == (
        "gpus_overlap", "GPUs 1-2 overlap engine group 0 of host big (tiny-tp2, GPUs 0-1)."
    )  # fmt: skip
    outside = ops.post("/api/ops/hosts/big/engine_groups",
                       {"deployment": "tiny-tp1", "first_gpu": 4})  # fmt: skip
    assert assert_error(outside, 400)["code"] == "gpus_out_of_range"
    assert assert_error(ops.post("/api/ops/hosts/big/engine_groups",
                                 {"deployment": "tiny-tp1", "gpu": 3}), 400)  # fmt: skip
    assert_error(ops.post("/api/ops/hosts/big/engine_groups", {"deployment": "nope"}), 404)
    assert_error(ops.post("/api/ops/hosts/nope/engine_groups", {"deployment": "tiny-tp1"}), 404)
    listed = ops.get("/api/ops/hosts/big/engine_groups").json()["data"]
    assert [(g["index"], g["deployment"], g["gpu_indices"]) for g in listed] == [
        (0, "tiny-tp2", [0, 1]), (1, "tiny-tp1", [2])
    ]  # fmt: skip
    host = ops.get("/api/ops/hosts/big").json()
    assert host["deployment"] == "tiny-tp2"
    assert [g["index"] for g in host["engine_groups"]] == [0, 1]
    (in_list,) = ops.get("/api/ops/hosts").json()["data"]
    assert in_list["engine_groups"] == host["engine_groups"]
    assert ops.delete("/api/ops/hosts/big/engine_groups/1").status_code == 204
    assert_error(ops.delete("/api/ops/hosts/big/engine_groups/1"), 404)
    assert EngineGroup.objects.count() == 1


def test_a_group_with_a_placed_job_is_not_removed(
    ops: ApiClient, fleet: None, tenant: Tenant, training_file: File
) -> None:
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    assert heartbeat("big", harvestable_tokens_per_s=50.0) == "applied"
    placement = job_place(job_id=job.id)
    group = EngineGroup.objects.get(index=0)
    assert placement is not None and placement.engine_group == group
    error = assert_error(ops.delete("/api/ops/hosts/big/engine_groups/0"), 409)
    assert error["code"] == "engine_group_busy" and str(placement.pk) in error["message"]
    (row,) = ops.get(f"/api/ops/placements?job={job.id}").json()["data"]
    assert (row["host"], row["engine_group"]) == ("big", 0)
    assert EngineGroup.objects.filter(pk=group.pk).exists()


def test_a_host_narrower_than_its_deployment_is_refused(ops: ApiClient, fleet: None) -> None:
    narrow = ops.post("/api/ops/hosts", {"name": "narrow", "gpu_kind": "H200",
                                         "gpu_memory_bytes": GIB,
                                         "deployment": "tiny-tp2"})  # fmt: skip
    assert "does not fit host narrow, whose GPUs are 0-0" in assert_error(narrow, 400)["message"]
    assert_error(ops.get("/api/ops/hosts/narrow"), 404)
