"""Engine groups and tensor parallelism in the services: a deployment's degree is checked
against its base model's shape, a host's groups stay inside its GPUs without overlap, a group
with an open placement cannot be removed, and nothing is written on an error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.errors import ConflictError, HarliError, NotFoundError
from api.models import Deployment, EngineGroup, GpuHost, Placement, PlacementState
from api.services.engine_groups import engine_group_add, engine_group_remove
from api.services.fleet import base_model_register, deployment_create, host_register
from tests.api.services.conftest import GIB, heartbeat, place_now

pytestmark = pytest.mark.django_db


def tp_deployment(name: str, base: Any, size: int) -> Deployment:
    return deployment_create(name=name, base_model=base, tpot_slo_ms=50, ttft_slo_ms=500,
                             tensor_parallel_size=size)  # fmt: skip


def eight_gpus(name: str = "big") -> GpuHost:
    return host_register(name=name, gpu_kind="H200", gpu_memory_bytes=141 * GIB, gpu_count=8)


def test_a_degree_the_shape_allows_is_stored_and_one_it_does_not_is_refused(tiny: Any) -> None:
    big = base_model_register(name="l70", preset="llama3-70b")
    assert tp_deployment("l70-tp8", big, 8).tensor_parallel_size == 8
    assert tp_deployment("tiny-tp4", tiny, 4).tensor_parallel_size == 4  # 2 KV heads replicate
    with pytest.raises(HarliError) as bad:
        tp_deployment("tiny-tp3", tiny, 3)
    assert bad.value.param == "tensor_parallel_size"
    assert "num_attention_heads 4 is not divisible by tensor_parallel_size 3" in bad.value.message
    assert "num_key_value_heads 2" in bad.value.message
    with pytest.raises(HarliError, match="outside 1..8"):
        tp_deployment("l70-tp16", big, 16)
    with pytest.raises(HarliError, match="outside 1..8"):
        tp_deployment("l70-tp0", big, 0)
    assert set(Deployment.objects.values_list("name", flat=True)) == {"l70-tp8", "tiny-tp4"}


def test_a_checkpoint_models_degree_is_checked_against_its_config_json(tmp_path: Path) -> None:
    shape = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 192,
             "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 3,
             "vocab_size": 128, "max_position_embeddings": 512}  # fmt: skip
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(shape))
    model = base_model_register(name="ckpt", checkpoint_dir=str(tmp_path / "ckpt"))
    assert tp_deployment("ckpt-tp3", model, 3).tensor_parallel_size == 3
    with pytest.raises(HarliError, match="num_key_value_heads 3 is not divisible by"):
        tp_deployment("ckpt-tp2", model, 2)  # 6 heads divide by 2, 3 KV heads do not
    (tmp_path / "bare").mkdir()
    bare = base_model_register(name="bare", checkpoint_dir=str(tmp_path / "bare"),
                               architecture="llama", context_length=512)  # fmt: skip
    assert tp_deployment("bare-tp1", bare, 1).tensor_parallel_size == 1
    with pytest.raises(HarliError, match="its shape is unknown"):
        tp_deployment("bare-tp2", bare, 2)
    assert not Deployment.objects.filter(name__in=["ckpt-tp2", "bare-tp2"]).exists()


def test_a_host_serves_groups_side_by_side_and_refuses_overlap_and_overflow(tiny: Any) -> None:
    tp4, tp2, tp1 = (tp_deployment(f"tiny-tp{t}", tiny, t) for t in (4, 2, 1))
    host = eight_gpus()
    first = engine_group_add(host=host, deployment=tp4)
    second = engine_group_add(host=host, deployment=tp2)  # the lowest free aligned range
    assert (first.index, first.gpu_indices) == (0, [0, 1, 2, 3])
    assert (second.index, second.gpu_indices) == (1, [4, 5])
    with pytest.raises(ConflictError) as overlap:
        engine_group_add(host=host, deployment=tp2, first_gpu=5)
    assert overlap.value.message == (
        "GPUs 5-6 overlap engine group 1 of host big (tiny-tp2, GPUs 4-5)."
    )
    with pytest.raises(HarliError) as overflow:
        engine_group_add(host=host, deployment=tp4, first_gpu=6)
    assert overflow.value.message == (
        "A tensor_parallel_size 4 group at GPUs 6-9 does not fit host big, whose GPUs are 0-7."
    )
    assert engine_group_add(host=host, deployment=tp1, first_gpu=7).gpu_indices == [7]
    assert engine_group_add(host=host, deployment=tp1).gpu_indices == [6]
    with pytest.raises(ConflictError, match=r"no 1 free GPUs in a row .*group 0: GPUs 0-3"):
        engine_group_add(host=host, deployment=tp1)
    assert list(host.engine_groups.values_list("index", "first_gpu")) == [
        (0, 0), (1, 4), (2, 7), (3, 6)
    ]  # fmt: skip


def test_eight_single_gpu_groups_fill_a_host(tiny: Any) -> None:
    tp1 = tp_deployment("tiny-tp1", tiny, 1)
    host = eight_gpus()
    groups = [engine_group_add(host=host, deployment=tp1) for _ in range(8)]
    assert [g.first_gpu for g in groups] == list(range(8))
    assert EngineGroup.objects.filter(host=host).count() == 8


def test_registering_a_host_narrower_than_its_deployment_writes_nothing(tiny: Any) -> None:
    tp4 = tp_deployment("tiny-tp4", tiny, 4)
    with pytest.raises(HarliError, match="does not fit host narrow, whose GPUs are 0-1"):
        host_register(name="narrow", gpu_kind="H200", gpu_memory_bytes=GIB, gpu_count=2,
                      deployment=tp4)  # fmt: skip
    assert not GpuHost.objects.filter(name="narrow").exists()
    wide = host_register(name="wide", gpu_kind="H200", gpu_memory_bytes=GIB, gpu_count=4,
                         deployment=tp4)  # fmt: skip
    assert [(g.index, g.gpu_indices) for g in wide.engine_groups.all()] == [(0, [0, 1, 2, 3])]


def test_a_group_with_an_open_placement_is_not_removed(
    deployment: Deployment, job: Any, django_capture_on_commit_callbacks: Any
) -> None:
    host = host_register(name="h1", gpu_kind="cpu", gpu_memory_bytes=16 * GIB, gpu_count=2,
                         deployment=deployment)  # fmt: skip
    spare = engine_group_add(host=host, deployment=deployment)
    heartbeat("h1", harvestable_tokens_per_s=10.0)
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.engine_group is not None
    assert placement.engine_group.index == 0  # group 1 is not in the heartbeat
    with pytest.raises(ConflictError) as busy:
        engine_group_remove(host=host, index=0)
    assert busy.value.message == (
        f"Engine group 0 of host h1 (tiny-chat, GPU 0) has open placements [{placement.pk}]; "
        "pause or cancel their jobs (or wait for them) first."
    )
    engine_group_remove(host=host, index=spare.index)
    Placement.objects.filter(pk=placement.pk).update(state=PlacementState.RELEASED)
    engine_group_remove(host=host, index=0)
    assert not host.engine_groups.exists()
    placement.refresh_from_db()
    assert placement.engine_group is None  # the closed placement keeps its row
    with pytest.raises(NotFoundError, match="Host h1 has no engine group 0."):
        engine_group_remove(host=host, index=0)
