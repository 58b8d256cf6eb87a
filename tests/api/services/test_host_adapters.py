"""An operator loads and unloads a fine-tuned model on one host: the signed commands reach the
host's queue (the in-memory broker) only after the order commits, the host's failure comes
back as a report and shows to the operator, an unloaded model is not offered to that host
again, and every refusal is clear — through the services, `/api/ops/` and `manage.py`."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from api.errors import ConflictError, NotFoundError
from api.models import Deployment, FinetuneJob, HostAdapterOrder
from api.services.fleet import base_model_register, deployment_create
from api.services.host_adapters import host_adapter_list, host_adapter_load, host_adapter_unload
from api.services.jobs import finetune_job_start, finetune_job_succeed, job_checkpoint_record
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import (
    adapter_key,
    checkpoint_key,
    checkpoint_model_name,
    report,
)
from tests.api.conftest import ApiClient, assert_error
from tests.api.services.conftest import drain_host_queue, heartbeat, make_host

pytestmark = pytest.mark.django_db


def _finished(job: FinetuneJob) -> tuple[str, str]:
    """The job succeeded with a step-2 checkpoint: (its model name, its checkpoint's)."""
    job = finetune_job_start(job=job)
    job_checkpoint_record(job=job, step=2, metrics={}, path=checkpoint_key(job.id, 2))
    job = finetune_job_succeed(job=job, trained_tokens=8, adapter_path=adapter_key(job.id))
    assert job.fine_tuned_model is not None
    return job.fine_tuned_model, checkpoint_model_name(job.fine_tuned_model, 2)


@pytest.fixture
def models(job: FinetuneJob, deployment: Deployment) -> tuple[str, str]:
    make_host("h1", deployment)
    heartbeat("h1")
    drain_host_queue("h1")
    return _finished(job)


def _commands(host: str) -> list[tuple[Any, ...]]:
    return [(c["command"], c["name"], c.get("storage_key")) for c in drain_host_queue(host)]


def test_load_and_unload_send_the_commands_after_commit(
    models: tuple[str, str], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    model, checkpoint = models
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        host_adapter_load(host_name="h1", model=model)
    assert _commands("h1") == []  # nothing before the commit
    for callback in callbacks:
        callback()
    assert _commands("h1") == [("load_adapter", model, adapter_key(job.id))]
    with django_capture_on_commit_callbacks(execute=True):
        host_adapter_load(host_name="h1", model=checkpoint)
    assert _commands("h1") == [("load_adapter", checkpoint, checkpoint_key(job.id, 2))]
    entries = host_adapter_list(host_name="h1")
    assert [(e.name, e.served, e.order) for e in entries] == [
        (model, False, "load"), (checkpoint, False, "load"),
    ]  # fmt: skip
    heartbeat("h1", adapters=[model, checkpoint])
    assert [e.served for e in host_adapter_list(host_name="h1")] == [True, True]
    with django_capture_on_commit_callbacks(execute=True):
        host_adapter_unload(host_name="h1", model=model)
    assert _commands("h1") == [("unload_adapter", model, None)]
    assert HostAdapterOrder.objects.get(name=model).action == "unload"


def test_an_unloaded_model_is_not_offered_to_that_host_again(
    models: tuple[str, str], django_capture_on_commit_callbacks: Any
) -> None:
    model, _ = models
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1")
    assert _commands("h1") == [("load_adapter", model, adapter_key(FinetuneJob.objects.get().id))]
    with django_capture_on_commit_callbacks(execute=True):
        host_adapter_unload(host_name="h1", model=model)
    drain_host_queue("h1")
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1")
    assert _commands("h1") == []  # the operator's unload holds
    with django_capture_on_commit_callbacks(execute=True):
        host_adapter_load(host_name="h1", model=model)
    drain_host_queue("h1")
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1")
    assert [c[:2] for c in _commands("h1")] == [("load_adapter", model)]  # offered again


def test_a_failed_load_is_recorded_until_the_model_is_served(
    models: tuple[str, str], django_capture_on_commit_callbacks: Any
) -> None:
    model, checkpoint = models
    with django_capture_on_commit_callbacks(execute=True):
        host_adapter_load(host_name="h1", model=checkpoint)
    message = report("adapter_load_failed", "h1", name=checkpoint, storage_key="checkpoints/x/y",
                     message="cannot serve checkpoints/x/y: not LORA")  # fmt: skip
    assert host_report_apply(message=message) == "applied"
    assert host_report_apply(message=message) == "duplicate"
    # a failure of a load the heartbeats asked for (no operator order) is recorded too
    other = report("adapter_load_failed", "h1", name=model, storage_key="adapters/x",
                   message="no complete tree")  # fmt: skip
    assert host_report_apply(message=other) == "applied"
    entries = {e.name: e for e in host_adapter_list(host_name="h1")}
    assert entries[checkpoint].failure == "cannot serve checkpoints/x/y: not LORA"
    assert entries[checkpoint].failed_at is not None and entries[checkpoint].order == "load"
    assert entries[model].failure == "no complete tree" and entries[model].order == "load"
    heartbeat("h1", adapters=[checkpoint])
    entries = {e.name: e for e in host_adapter_list(host_name="h1")}
    assert entries[checkpoint].failure == "" and entries[checkpoint].failed_at is None
    assert entries[checkpoint].served
    assert entries[model].failure == "no complete tree"


def test_refusals_are_clear(models: tuple[str, str], deployment: Deployment) -> None:
    model, _ = models
    with pytest.raises(NotFoundError, match="No host named 'nope'"):
        host_adapter_load(host_name="nope", model=model)
    with pytest.raises(NotFoundError, match="No fine-tuned model named 'ft:x'"):
        host_adapter_load(host_name="h1", model="ft:x")
    other = base_model_register(name="other", preset="tiny")
    make_host("h2", deployment_create(name="other-chat", base_model=other, tpot_slo_ms=50,
                                      ttft_slo_ms=500))  # fmt: skip
    with pytest.raises(ConflictError, match="has not reported") as silent:
        host_adapter_load(host_name="h2", model=model)
    assert silent.value.code == "host_not_reported"
    heartbeat("h2", base_model="other")
    with pytest.raises(ConflictError, match="serves base model 'other'") as mismatch:
        host_adapter_load(host_name="h2", model=model)
    assert mismatch.value.code == "base_model_mismatch"
    with pytest.raises(NotFoundError, match="does not serve it"):
        host_adapter_unload(host_name="h1", model="ops-poet")
    heartbeat("h1", adapters=["ops-poet"])  # an operator loaded it on the host itself
    drain_host_queue("h1")
    host_adapter_unload(host_name="h1", model="ops-poet")
    assert not HostAdapterOrder.objects.filter(host__name="h2").exists()


def test_the_ops_api(
    models: tuple[str, str], ops: ApiClient, api: ApiClient,
    django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    model, checkpoint = models
    base = "/api/ops/hosts/h1/adapters"
    with django_capture_on_commit_callbacks(execute=True):
        loaded = ops.post(f"{base}/load", {"model": model})
    assert loaded.status_code == 202, loaded.content
    assert loaded.json() == {"name": model, "served": False, "order": "load", "failure": "",
                             "failed_at": None}  # fmt: skip
    assert [c[:2] for c in _commands("h1")] == [("load_adapter", model)]
    heartbeat("h1", adapters=[model])
    listing = ops.get(base).json()
    assert listing["object"] == "list"
    assert [(e["name"], e["served"], e["order"]) for e in listing["data"]] == [
        (model, True, "load")
    ]
    with django_capture_on_commit_callbacks(execute=True):
        unloaded = ops.post(f"{base}/unload", {"model": model})
    assert unloaded.status_code == 202 and unloaded.json()["order"] == "unload"
    assert [c[:2] for c in _commands("h1")] == [("unload_adapter", model)]
    assert_error(ops.post(f"{base}/load", {"model": checkpoint, "force": True}), 400,
                 param="force")  # fmt: skip
    assert_error(ops.post(f"{base}/load", {}), 400, param="model")
    assert_error(ops.post(f"{base}/load", {"model": "ft:nope"}), 404, param="model")
    assert_error(ops.post("/api/ops/hosts/nope/adapters/load", {"model": model}), 404,
                 param="host")  # fmt: skip
    assert_error(ops.get("/api/ops/hosts/nope/adapters"), 404, param="host")
    for path in (base, f"{base}/load", f"{base}/unload"):
        refused = api.post(path, {"model": model}) if path != base else api.get(path)
        assert refused.status_code in (401, 403, 404), path
    assert _commands("h1") == []


def test_the_management_command(
    models: tuple[str, str], django_capture_on_commit_callbacks: Any
) -> None:
    model, _ = models
    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("host_adapter", "load", "--host", "h1", "--model", model, stdout=out)
    assert f"Sent load_adapter {model} to host h1" in out.getvalue()
    assert [c[:2] for c in _commands("h1")] == [("load_adapter", model)]
    out = StringIO()
    call_command("host_adapter", "list", "--host", "h1", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["MODEL", "SERVED", "ORDER", "FAILURE", "FAILED", "AT"]
    assert lines[1].split() == [model, "no", "load", "-", "-"]
    with django_capture_on_commit_callbacks(execute=True):
        call_command("host_adapter", "unload", "--host", "h1", "--model", model, stdout=out)
    assert [c[:2] for c in _commands("h1")] == [("unload_adapter", model)]
    with pytest.raises(CommandError, match="No host named 'nope'"):
        call_command("host_adapter", "load", "--host", "nope", "--model", model)
    with pytest.raises(CommandError, match="No fine-tuned model named 'ft:x'"):
        call_command("host_adapter", "load", "--host", "h1", "--model", "ft:x")
