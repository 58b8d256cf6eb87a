"""A tenant's fine-tuned models: downloaded as PEFT archives that load in `peft` with the stored
weights, retrieved (checkpoints too, never listed), and deleted in OpenAI's shape, with the
stored bytes removed and every host told to unload the model only once the deletion commits."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from api.models import Adapter, FinetuneJob, JobCheckpoint, JobEvent, Tenant
from api.services.jobs import (
    finetune_job_create,
    finetune_job_start,
    finetune_job_succeed,
    job_checkpoint_record,
)
from api.storage import get_storage
from gpu_runtime.contract.protocol import adapter_key, checkpoint_key, checkpoint_model_name
from tests.api.conftest import ApiClient, assert_error

pytestmark = pytest.mark.django_db


@dataclass
class Trained:
    job: FinetuneJob
    model: str
    checkpoint: JobCheckpoint
    checkpoint_model: str
    base_dir: Path  # the tiny base model in HF format
    adapter_dir: Path
    checkpoint_dir: Path


def _peft_tree(base: Any, directory: Path, seed: int) -> Path:
    from gpu_runtime.contract.hparams import LoraSpec
    from gpu_runtime.finetune.checkpoint import save_adapter
    from gpu_runtime.finetune.lora import adapter_parameters, build_training_model

    spec = LoraSpec(rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj"))
    tree = build_training_model(base, spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_parameters(tree):  # trained-looking: B non-zero
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    save_adapter(tree, spec, directory, base_model_name_or_path="/hosts/local/tiny-model")
    return directory


def make_trained(tenant: Tenant, file_id: str, tmp_path: Path) -> Trained:
    """A succeeded job whose adapter and step-2 checkpoint are stored as the host stores them
    (the checkpoint with trainer state beside its PEFT files)."""
    from gpu_runtime.model import build_random_model, save_model
    from gpu_runtime.model.tiny import tiny_config

    base = build_random_model(tiny_config("llama"), seed=2, dtype="float32")
    save_model(base, tmp_path / "base")
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=file_id, suffix="dl")
    job = finetune_job_start(job=job)
    checkpoint_dir = _peft_tree(base, tmp_path / "ckpt", seed=3)
    (checkpoint_dir / "trainer_state.pt").write_bytes(b"optimizer state")
    storage = get_storage()
    storage.put_tree(checkpoint_key(job.id, 2), checkpoint_dir)
    checkpoint = job_checkpoint_record(
        job=job, step=2, metrics={"train_loss": 1.0}, path=checkpoint_key(job.id, 2)
    )
    adapter_dir = _peft_tree(base, tmp_path / "adapter", seed=4)
    storage.put_tree(adapter_key(job.id), adapter_dir)
    job = finetune_job_succeed(job=job, trained_tokens=10, adapter_path=adapter_key(job.id))
    assert job.fine_tuned_model is not None
    return Trained(
        job=job,
        model=job.fine_tuned_model,
        checkpoint=checkpoint,
        checkpoint_model=checkpoint_model_name(job.fine_tuned_model, 2),
        base_dir=tmp_path / "base",
        adapter_dir=adapter_dir,
        checkpoint_dir=checkpoint_dir,
    )


@pytest.fixture
def trained(tiny: object, tenant: Tenant, training_file: Any, tmp_path: Path) -> Trained:
    return make_trained(tenant, training_file.id, tmp_path)


def _untar(response: Any, into: Path) -> Path:
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "application/gzip"
    body = b"".join(response.streaming_content)
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as archive:
        names = sorted(archive.getnames())
        archive.extractall(into, filter="data")
    (directory,) = {name.split("/")[0] for name in names}
    assert names == [
        directory,
        f"{directory}/adapter_config.json",
        f"{directory}/adapter_model.safetensors",
    ]  # PEFT files only: no trainer state
    assert f'filename="{directory}.tar.gz"' in response["Content-Disposition"]
    return into / directory


def _assert_peft_loads_the_stored_weights(unpacked: Path, stored: Path, base_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((unpacked / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny"  # not the host's path
    hf = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, str(unpacked)).eval()
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    expected = load_file(str(stored / "adapter_model.safetensors"))
    assert len(loaded) == len(expected) > 0
    for key, tensor in expected.items():  # PEFT keys: ...lora_A.weight -> ...lora_A.default.weight
        peft_key = key.replace(".weight", ".default.weight")
        torch.testing.assert_close(loaded[peft_key], tensor, rtol=0, atol=0)


def test_download_adapter_and_checkpoints_load_in_peft_with_the_stored_weights(
    api: ApiClient, trained: Trained, tmp_path: Path
) -> None:
    adapter = _untar(api.get(f"/v1/models/{trained.model}/content"), tmp_path / "got-adapter")
    assert adapter.name == trained.model.replace(":", "-")
    _assert_peft_loads_the_stored_weights(adapter, trained.adapter_dir, trained.base_dir)

    by_id = _untar(
        api.get(
            f"/v1/fine_tuning/jobs/{trained.job.id}/checkpoints/{trained.checkpoint.id}/content"
        ),
        tmp_path / "got-ckpt",
    )
    assert by_id.name.endswith("-ckpt-step-2")
    _assert_peft_loads_the_stored_weights(by_id, trained.checkpoint_dir, trained.base_dir)
    by_name = _untar(
        api.get(f"/v1/models/{trained.checkpoint_model}/content"), tmp_path / "got-ckpt-name"
    )
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (by_name / name).read_bytes() == (by_id / name).read_bytes()


def test_download_of_weights_no_longer_stored_is_a_404_that_names_no_path(
    api: ApiClient, trained: Trained
) -> None:
    get_storage().delete_tree(adapter_key(trained.job.id))
    error = assert_error(api.get(f"/v1/models/{trained.model}/content"), 404, param="model")
    assert error["code"] == "adapter_not_stored" and "adapters/" not in error["message"]
    assert_error(api.get("/v1/models/tiny/content"), 404, param="model")  # a base model
    unknown = f"/v1/fine_tuning/jobs/{trained.job.id}/checkpoints/ftckpt-none/content"
    assert_error(api.get(unknown), 404, param="checkpoint_id")


def test_a_checkpoint_is_retrieved_by_name_but_not_listed(api: ApiClient, trained: Trained) -> None:
    listed = api.get(f"/v1/fine_tuning/jobs/{trained.job.id}/checkpoints").json()["data"]
    assert listed[0]["fine_tuned_model_checkpoint"] == trained.checkpoint_model
    retrieved = api.get(f"/v1/models/{trained.checkpoint_model}")
    assert retrieved.status_code == 200
    assert retrieved.json()["id"] == trained.checkpoint_model
    assert retrieved.json()["owned_by"] == "acme"
    ids = [m["id"] for m in api.get("/v1/models").json()["data"]]
    assert ids == ["tiny", trained.model]
    for wrong in (
        checkpoint_model_name(trained.model, 3),  # no such step
        checkpoint_model_name(trained.model.replace(":dl:", ":xx:"), 2),  # not the job's name
        checkpoint_model_name(trained.model, 2).replace("step-2", "step-02"),
    ):
        assert_error(api.get(f"/v1/models/{wrong}"), 404, param="model")


def test_delete_removes_the_model_then_its_bytes_and_unloads_it_after_commit(
    api: ApiClient, trained: Trained, django_capture_on_commit_callbacks: Any
) -> None:
    from api.models import HostAgentState
    from tests.api.services.conftest import drain_host_queue, heartbeat, make_host

    deployment = _deployment()
    make_host("h1", deployment)  # serves the base model
    make_host("h2", None)  # serves nothing of it, but its last heartbeat named the model
    heartbeat("h2", adapters=[trained.model])
    for host in ("h1", "h2"):
        drain_host_queue(host)
    storage = get_storage()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api.delete(f"/v1/models/{trained.model}")
        assert response.status_code == 200
        assert response.json() == {"id": trained.model, "object": "model", "deleted": True}
    assert not Adapter.objects.filter(name=trained.model).exists()
    assert storage.exists(f"{adapter_key(trained.job.id)}/adapter_model.safetensors")
    assert drain_host_queue("h1") == []  # nothing before the commit
    for callback in callbacks:
        callback()
    assert storage.list_keys(adapter_key(trained.job.id)) == []
    for host in ("h1", "h2"):
        (command,) = drain_host_queue(host)
        assert (command["command"], command["name"]) == ("unload_adapter", trained.model)
    assert HostAgentState.objects.get(host__name="h2").adapters == [trained.model]

    job = FinetuneJob.objects.get(pk=trained.job.id)
    assert job.fine_tuned_model == trained.model  # the job keeps its name, as OpenAI's
    assert JobEvent.objects.filter(job=job, message__startswith="Fine-tuned model deleted").exists()
    assert_error(api.get(f"/v1/models/{trained.model}"), 404, param="model")
    assert trained.model not in [m["id"] for m in api.get("/v1/models").json()["data"]]
    assert_error(api.get(f"/v1/models/{trained.model}/content"), 404, param="model")
    assert_error(api.delete(f"/v1/models/{trained.model}"), 404, param="model")
    # Its checkpoint is a model of its own and stays.
    assert api.get(f"/v1/models/{trained.checkpoint_model}").status_code == 200


def test_deleting_a_checkpoint_waits_for_its_job_to_end(
    api: ApiClient, trained: Trained, tenant: Tenant, training_file: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    running = finetune_job_start(
        job=finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    )
    job_checkpoint_record(job=running, step=5, metrics={}, path=checkpoint_key(running.id, 5))
    name = checkpoint_model_name(f"ft:tiny:acme::{running.id}", 5)
    error = assert_error(api.delete(f"/v1/models/{name}"), 409, param="model")
    assert error["code"] == "checkpoint_in_use"
    assert JobCheckpoint.objects.filter(job=running, step=5).exists()

    with django_capture_on_commit_callbacks(execute=True):
        response = api.delete(f"/v1/models/{trained.checkpoint_model}")
    assert response.json() == {"id": trained.checkpoint_model, "object": "model", "deleted": True}
    assert not JobCheckpoint.objects.filter(pk=trained.checkpoint.id).exists()
    assert get_storage().list_keys(checkpoint_key(trained.job.id, 2)) == []
    assert_error(api.get(f"/v1/models/{trained.checkpoint_model}"), 404, param="model")
    assert api.get(f"/v1/models/{trained.model}").status_code == 200  # the adapter stays


def test_base_models_cannot_be_deleted(api: ApiClient, tiny: object) -> None:
    error = assert_error(api.delete("/v1/models/tiny"), 403, param="model")
    assert error["code"] == "model_not_deletable"
    assert api.get("/v1/models/tiny").status_code == 200
    assert_error(api.delete("/v1/models/ft:tiny:acme::ftjob-none"), 404, param="model")


def test_heartbeats_unload_deleted_models_and_never_offer_them_again(
    api: ApiClient, trained: Trained, tenant: Tenant, training_file: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    from tests.api.services.conftest import drain_host_queue, heartbeat, make_host

    make_host("h1", _deployment())
    running = finetune_job_start(
        job=finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    )
    just_finished = f"ft:tiny:acme::{running.id}"  # served before its success is recorded
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", adapters=[])
    (offer,) = drain_host_queue("h1")  # the finished adapter, offered to a host without it
    assert (offer["command"], offer["name"]) == ("load_adapter", trained.model)
    with django_capture_on_commit_callbacks(execute=True):
        api.delete(f"/v1/models/{trained.model}")
        api.delete(f"/v1/models/{trained.checkpoint_model}")
    drain_host_queue("h1")
    # The host missed the unloads and still serves both, plus a live job's adapter.
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", adapters=[trained.model, trained.checkpoint_model, just_finished])
    unloads = drain_host_queue("h1")
    assert sorted((c["command"], c["name"]) for c in unloads) == sorted(
        [("unload_adapter", trained.model), ("unload_adapter", trained.checkpoint_model)]
    )
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", adapters=[just_finished])  # unloaded: nothing offers it back
    assert drain_host_queue("h1") == []


def _deployment() -> Any:
    from api.models import BaseModel
    from api.services.fleet import deployment_create

    return deployment_create(
        name="tiny-chat", base_model=BaseModel.objects.get(name="tiny"), tpot_slo_ms=50,
        ttft_slo_ms=500,
    )  # fmt: skip


def test_another_tenant_cannot_see_download_or_delete_checkpoint_models(
    trained: Trained, other_key: str
) -> None:
    outsider = ApiClient(other_key)
    for path in (f"/v1/models/{trained.checkpoint_model}",
                 f"/v1/models/{trained.checkpoint_model}/content"):  # fmt: skip
        assert_error(outsider.get(path), 404, param="model")
    assert_error(outsider.delete(f"/v1/models/{trained.checkpoint_model}"), 404, param="model")
    assert JobCheckpoint.objects.filter(pk=trained.checkpoint.id).exists()
