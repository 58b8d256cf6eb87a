"""`/v1/fine_tuning/jobs`: create (validation, queueing), list paging, lifecycle actions, events."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import BaseModel, File, FinetuneJob, JobEvent, JobStatus
from api.services.jobs import finetune_job_start, finetune_job_succeed, job_checkpoint_record
from tests.api.conftest import ApiClient, assert_error

pytestmark = pytest.mark.django_db


def create(api: ApiClient, file: File, **extra: Any) -> Any:
    return api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": file.id, **extra})


def test_create_queues_and_dispatches_after_commit(
    api: ApiClient, training_file: File, tiny: BaseModel, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = create(
            api,
            training_file,
            suffix="demo",
            seed=7,
            hyperparameters={"n_epochs": 2},
            lora={"rank": 8, "target_modules": ["q_proj", "v_proj"]},
        )
    assert response.status_code == 200, response.content
    assert len(callbacks) == 1
    job = response.json()
    assert job["object"] == "fine_tuning.job"
    assert job["status"] == "queued"
    assert job["model"] == "tiny"
    assert job["training_file"] == training_file.id
    assert job["hyperparameters"] == {
        "n_epochs": 2,
        "batch_size": "auto",
        "learning_rate_multiplier": "auto",
    }
    assert job["lora"] == {
        "rank": 8,
        "alpha": 32.0,
        "dropout": 0.05,
        "target_modules": ["q_proj", "v_proj"],
    }
    assert job["seed"] == 7 and job["user_provided_suffix"] == "demo"
    assert job["fine_tuned_model"] is None and job["error"] is None
    messages = [
        e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]
    ]
    assert messages == [
        "Job queued; waiting for a host",
        "Files validated; job queued",
        f"Validating training file: {training_file.id}",
        f"Created fine-tuning job: {job['id']}",
    ]


def test_method_shape_is_accepted(api: ApiClient, training_file: File, tiny: BaseModel) -> None:
    method = {
        "type": "supervised",
        "supervised": {"hyperparameters": {"batch_size": 4, "learning_rate_multiplier": 0.5}},
    }
    job = create(api, training_file, method=method).json()
    assert job["hyperparameters"] == {
        "n_epochs": "auto",
        "batch_size": 4,
        "learning_rate_multiplier": 0.5,
    }


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"hyperparameters": {"n_epochs": 0}}, "n_epochs"),
        ({"hyperparameters": {"n_epochs": "many"}}, "n_epochs"),
        ({"hyperparameters": {"batch_size": 1000}}, "batch_size"),
        ({"hyperparameters": {"learning_rate_multiplier": -1}}, "learning_rate_multiplier"),
        ({"hyperparameters": {"warmup": 3}}, "hyperparameters.warmup"),
        ({"method": {"type": "reinforcement"}}, "method.type"),
        ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}}, "beta"),
        ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 2.5}}}}, "beta"),
        ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": "x"}}}}, "beta"),
        ({"method": {"type": "dpo"}}, "training_file"),  # a chat file
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"rank": 128}}, "lora.rank"),  # trainable, but larger than hosts serve
        ({"lora": {"dropout": 1.5}}, "lora.dropout"),
        ({"lora": {"target_modules": []}}, "lora.target_modules"),
        ({"suffix": "has:colon"}, "suffix"),
        ({"seed": -1}, "seed"),
        ({"model": "no-such-model"}, "model"),
        ({"training_file": "file-doesnotexist"}, "training_file"),
        ({"validation_file": "file-doesnotexist"}, "validation_file"),
    ],
)
def test_invalid_input_is_rejected_and_nothing_is_written(
    api: ApiClient, training_file: File, tiny: BaseModel, extra: dict[str, Any], param: str
) -> None:
    assert_error(create(api, training_file, **extra), 400, param=param)
    assert not FinetuneJob.objects.exists()
    assert not JobEvent.objects.exists()


def test_missing_required_fields(api: ApiClient, tiny: BaseModel) -> None:
    assert_error(api.post("/v1/fine_tuning/jobs", {"model": "tiny"}), 400, param="training_file")
    assert_error(api.post("/v1/fine_tuning/jobs", {"training_file": "x"}), 400, param="model")
    response = api.post("/v1/fine_tuning/jobs", "not json", content_type="application/json")
    assert_error(response, 400)


def test_list_pages_with_after_and_limit(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    ids = [create(api, training_file).json()["id"] for _ in range(5)]
    newest_first = list(reversed(ids))
    first = api.get("/v1/fine_tuning/jobs?limit=2").json()
    assert [j["id"] for j in first["data"]] == newest_first[:2]
    assert first["has_more"] is True
    second = api.get(f"/v1/fine_tuning/jobs?limit=2&after={first['data'][-1]['id']}").json()
    assert [j["id"] for j in second["data"]] == newest_first[2:4]
    third = api.get(f"/v1/fine_tuning/jobs?limit=2&after={second['data'][-1]['id']}").json()
    assert [j["id"] for j in third["data"]] == newest_first[4:]
    assert third["has_more"] is False
    assert_error(api.get("/v1/fine_tuning/jobs?limit=0"), 400, param="limit")
    assert_error(api.get("/v1/fine_tuning/jobs?after=ftjob-unknown"), 400, param="after")


def test_cancel_pause_resume(api: ApiClient, training_file: File, tiny: BaseModel) -> None:
    job_id = create(api, training_file).json()["id"]
    paused = api.post(f"/v1/fine_tuning/jobs/{job_id}/pause").json()
    assert paused["status"] == "paused"
    error = assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/pause"), 409)
    assert error["code"] == "invalid_job_state"
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/resume").json()["status"] == "queued"
    cancelled = api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel"), 409)
    assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/resume"), 409)


def test_checkpoints_and_finished_model(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    job_id = create(api, training_file, suffix="s1").json()["id"]
    job = FinetuneJob.objects.get(pk=job_id)
    finetune_job_start(job=job)
    for step in (10, 20, 30):
        job_checkpoint_record(job=job, step=step, metrics={"train_loss": 3.0 - step / 10})
    listing = api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints?limit=2").json()
    assert [c["step_number"] for c in listing["data"]] == [30, 20]
    assert listing["has_more"] is True
    assert listing["data"][0]["metrics"] == {"step": 30, "train_loss": 0.0}
    rest = api.get(
        f"/v1/fine_tuning/jobs/{job_id}/checkpoints?after={listing['data'][-1]['id']}"
    ).json()
    assert [c["step_number"] for c in rest["data"]] == [10]
    name = f"ft:tiny:acme:s1:{job_id}"
    assert listing["data"][0]["fine_tuned_model_checkpoint"] == f"{name}:ckpt-step-30"

    finetune_job_succeed(job=job, trained_tokens=1234, adapter_path="/tmp/adapter")
    finished = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert finished["status"] == "succeeded"
    assert finished["fine_tuned_model"] == name and finished["trained_tokens"] == 1234
    models = [m["id"] for m in api.get("/v1/models").json()["data"]]
    assert models == ["tiny", name]
    assert api.get(f"/v1/models/{name}").json()["owned_by"] == "acme"
    assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel"), 409)


def test_job_status_only_moves_through_the_table(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    job = FinetuneJob.objects.get(pk=create(api, training_file).json()["id"])
    assert job.status == JobStatus.QUEUED
    with pytest.raises(Exception, match="cannot become succeeded"):
        finetune_job_succeed(job=job, trained_tokens=1, adapter_path="")
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and job.fine_tuned_model is None
