"""The admin CLI for tensor parallelism: `deployments create --tensor-parallel-size`, and a
host's engine groups (`hosts register --deployment`, `groups`, `add-group`, `remove-group`)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from api.models import Deployment, EngineGroup, GpuHost, Placement, PlacementState
from api.services.files import UploadSource, file_create
from api.services.jobs import finetune_job_create
from api.services.placement import job_place
from api.services.tenants import tenant_create
from tests.api.services.conftest import heartbeat

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def _deploy(name: str, size: int) -> str:
    return run("deployments", "create", name, "--base-model", "tiny", "--tpot-slo-ms", "50",
               "--ttft-slo-ms", "500", "--tensor-parallel-size", str(size))  # fmt: skip


def test_deployments_take_a_degree_the_shape_allows() -> None:
    run("basemodels", "register", "tiny", "--preset", "tiny")
    assert "tensor parallel 2, engine harli." in _deploy("tiny-tp2", 2)
    with pytest.raises(CommandError, match="num_attention_heads 4 is not divisible by"):
        _deploy("tiny-tp3", 3)
    assert list(Deployment.objects.values_list("name", flat=True)) == ["tiny-tp2"]
    listing = run("deployments", "list").splitlines()
    assert listing[0].split()[-2:] == ["TP", "ENGINE"] and listing[1].split()[-2:] == ["2", "harli"]


def test_hosts_serve_groups_that_are_added_listed_and_removed() -> None:
    run("basemodels", "register", "tiny", "--preset", "tiny")
    _deploy("tiny-tp2", 2)
    _deploy("tiny-tp1", 1)
    with pytest.raises(CommandError, match="does not fit host small, whose GPUs are 0-0"):
        run("hosts", "register", "small", "--gpu-kind", "H200", "--gpu-memory-gb", "141",
            "--deployment", "tiny-tp2")  # fmt: skip
    assert not GpuHost.objects.exists()
    run("hosts", "register", "big", "--gpu-kind", "H200", "--gpu-memory-gb", "141",
        "--gpu-count", "4", "--deployment", "tiny-tp2")  # fmt: skip
    assert run("hosts", "add-group", "big", "--deployment", "tiny-tp1") == (
        "Host big serves tiny-tp1 in engine group 1 (GPU 2).\n"
    )
    with pytest.raises(CommandError, match=r"GPUs 2-3 overlap engine group 1 of host big"):
        run("hosts", "add-group", "big", "--deployment", "tiny-tp2", "--first-gpu", "2")
    rows = [line.split() for line in run("hosts", "groups", "big").splitlines()]
    assert rows == [["INDEX", "DEPLOYMENT", "TP", "GPUS"], ["0", "tiny-tp2", "2", "GPUs", "0-1"],
                    ["1", "tiny-tp1", "1", "GPU", "2"]]  # fmt: skip
    assert "tiny-tp2@GPUs 0-1, tiny-tp1@GPU 2" in run("hosts", "list")
    assert run("hosts", "remove-group", "big", "1") == "Removed engine group 1 of host big.\n"
    with pytest.raises(CommandError, match="Host big has no engine group 1."):
        run("hosts", "remove-group", "big", "1")
    assert EngineGroup.objects.count() == 1


def test_a_group_training_a_job_is_not_removed(django_capture_on_commit_callbacks: object) -> None:
    run("basemodels", "register", "tiny", "--preset", "tiny")
    run("deployments", "create", "tiny-chat", "--base-model", "tiny", "--tpot-slo-ms", "50",
        "--ttft-slo-ms", "500")  # fmt: skip
    run("hosts", "register", "h1", "--gpu-kind", "cpu", "--gpu-memory-gb", "16",
        "--deployment", "tiny-chat")  # fmt: skip
    tenant = tenant_create(name="acme")
    data = b'{"prompt": "a", "completion": "b"}\n' * 4
    file = file_create(tenant=tenant, purpose="fine-tune",
                       upload=UploadSource.from_bytes(filename="t.jsonl", data=data))  # fmt: skip
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=file.id)
    assert heartbeat("h1", harvestable_tokens_per_s=10.0) == "applied"
    placement = job_place(job_id=job.id)
    assert placement is not None
    with pytest.raises(CommandError, match=rf"has open placements \[{placement.pk}\]"):
        run("hosts", "remove-group", "h1", "0")
    run("jobs", "cancel", job.id)  # releases its placement
    assert Placement.objects.get(pk=placement.pk).state == PlacementState.RELEASED
    assert "Removed engine group 0" in run("hosts", "remove-group", "h1", "0")
