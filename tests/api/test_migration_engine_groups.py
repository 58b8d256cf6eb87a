"""Migration 0015 moves each host's deployment into its engine group 0 at GPU 0 (its decode
metrics and its agent's last heartbeat with it), and back when reversed."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("api", "0014_host_adapter_order")]
AFTER = [("api", "0015_engine_groups")]


def _migrate(target: list[tuple[str, str]]) -> Any:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(target)
    return executor.loader.project_state(target).apps


@pytest.mark.django_db(transaction=True)
def test_each_hosts_deployment_becomes_its_group_0() -> None:
    old = _migrate(BEFORE)
    try:
        base = old.get_model("api", "BaseModel").objects.create(
            name="tiny", architecture="llama", config={"model_type": "llama"}, context_length=64
        )
        deployment = old.get_model("api", "Deployment").objects.create(
            name="chat", base_model=base, tpot_slo_ms=50, ttft_slo_ms=500
        )
        hosts = old.get_model("api", "GpuHost").objects
        serving = hosts.create(name="h1", gpu_kind="H200", gpu_memory_bytes=1, gpu_count=8,
                               deployment=deployment)  # fmt: skip
        hosts.create(name="h2", gpu_kind="H200", gpu_memory_bytes=1)
        old.get_model("api", "HostAgentState").objects.create(
            host=serving, base_model="tiny", free_bytes=5, harvestable_tokens_per_s=7.0,
            placements=[3],
        )  # fmt: skip
        old.get_model("api", "DeploymentMetric").objects.create(
            deployment=deployment, host=serving, ts="2026-12-01T00:00:00Z", tpot_p50_ms=1,
            tpot_p99_ms=2, slo_attainment=1.0,
        )  # fmt: skip

        new = _migrate(AFTER)
        (group,) = new.get_model("api", "EngineGroup").objects.all()
        assert (group.host.name, group.deployment.name, group.index, group.first_gpu) == (
            "h1", "chat", 0, 0
        )  # fmt: skip
        assert new.get_model("api", "Deployment").objects.get().tensor_parallel_size == 1
        assert new.get_model("api", "DeploymentMetric").objects.get().engine_group_id == group.pk
        (entry,) = new.get_model("api", "HostAgentState").objects.get().engine_groups
        assert (entry["index"], entry["free_bytes_per_gpu"], entry["placements"]) == (0, 5, [3])
        assert entry["harvestable_tokens_per_s"] == 7.0

        back = _migrate(BEFORE)
        deployments = dict(back.get_model("api", "GpuHost").objects.values_list(
            "name", "deployment__name"))  # fmt: skip
        assert deployments == {"h1": "chat", "h2": None}
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
