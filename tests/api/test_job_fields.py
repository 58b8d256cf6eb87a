"""Every field of a job is computed: estimated_finish (the console's ETA), trained_tokens,
resolved hyperparameters, result_files (downloadable, never a training file), metadata (stored,
filtered), integrations (refused); unknown parameters are refused, not dropped."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from api.models import BaseModel, File, FinetuneJob, JobMetric
from api.progress import job_progress_map
from api.services.job_results import (
    finetune_job_settings_record,
    finetune_job_trained_tokens_update,
    job_result_file_create,
)
from api.services.jobs import finetune_job_start, finetune_job_succeed
from console import selectors as console_selectors
from tests.api.conftest import ApiClient, assert_error

pytestmark = pytest.mark.django_db


def create(api: ApiClient, file: File, **extra: Any) -> Any:
    return api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": file.id, **extra})


def test_integrations_are_refused_and_nothing_is_created(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    wandb = [{"type": "wandb", "wandb": {"project": "demo"}}]
    error = assert_error(create(api, training_file, integrations=wandb), 400, param="integrations")
    assert "wandb" in error["message"] and error["code"] == "unsupported_integration"
    assert not FinetuneJob.objects.exists()
    job = create(api, training_file, integrations=[]).json()  # asking for none is fine
    assert job["integrations"] == []


def test_unknown_create_parameter_is_refused(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    assert_error(create(api, training_file, epochs=3), 400, param="epochs")
    assert not FinetuneJob.objects.exists()


@pytest.mark.parametrize(
    "metadata",
    [{"k": 1}, ["a"], {f"k{i}": "v" for i in range(17)}, {"x" * 65: "v"}, {"k": "v" * 513}],
)
def test_bad_metadata_is_refused(
    api: ApiClient, training_file: File, tiny: BaseModel, metadata: Any
) -> None:
    assert_error(create(api, training_file, metadata=metadata), 400, param="metadata")


def test_metadata_is_stored_and_filters_the_list(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    a = create(api, training_file, metadata={"team": "search", "run": "a"}).json()
    b = create(api, training_file, metadata={"team": "search", "run": "b__x"}).json()
    create(api, training_file, metadata={"team": "ads"})
    create(api, training_file)
    assert a["metadata"] == {"team": "search", "run": "a"}

    def ids(query: str) -> list[str]:
        response = api.get(f"/v1/fine_tuning/jobs?{query}")
        assert response.status_code == 200, response.content
        return [job["id"] for job in response.json()["data"]]

    assert ids("metadata[team]=search") == [b["id"], a["id"]]
    assert ids("metadata[team]=search&metadata[run]=b__x") == [b["id"]]
    assert ids("metadata[team]=nobody") == []
    assert ids("metadata[team__contains]=sea") == []  # a key, never a lookup
    assert len(ids("limit=10")) == 4
    assert_error(api.get("/v1/fine_tuning/jobs?status=running"), 400, param="status")
    assert_error(api.get("/v1/fine_tuning/jobs?metadata=x"), 400, param="metadata")


def test_estimated_finish_is_the_consoles_eta_while_running(
    api: ApiClient, training_file: File, tiny: BaseModel
) -> None:
    job = FinetuneJob.objects.get(pk=create(api, training_file).json()["id"])
    assert api.get(f"/v1/fine_tuning/jobs/{job.id}").json()["estimated_finish"] is None
    finetune_job_start(job=job)
    finetune_job_settings_record(
        job=job,
        hyperparameters={"n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": 1.0},
        total_steps=40,
    )
    start = timezone.now() - timedelta(seconds=100)
    for step in range(1, 11):  # one step per 10 s: 30 steps left -> 300 s after the last
        JobMetric.objects.create(
            job=job, ts=start + timedelta(seconds=10 * step), step=step, train_loss=1.0
        )
    finetune_job_trained_tokens_update(job=job, trained_tokens=500)
    body = api.get(f"/v1/fine_tuning/jobs/{job.id}").json()
    last = start + timedelta(seconds=100)
    assert body["estimated_finish"] == int((last + timedelta(seconds=300)).timestamp())
    assert body["trained_tokens"] == 500
    assert body["hyperparameters"] == {
        "n_epochs": 2,
        "batch_size": 1,
        "learning_rate_multiplier": 1.0,
    }
    job.refresh_from_db()
    console = console_selectors.job_progress_map(jobs=[job])[job.id]
    assert console == job_progress_map(jobs=[job])[job.id]
    assert console.eta_seconds == pytest.approx(300.0) and console.total_steps == 40
    listed = api.get("/v1/fine_tuning/jobs").json()["data"][0]
    assert listed["estimated_finish"] == body["estimated_finish"]
    api.post(f"/v1/fine_tuning/jobs/{job.id}/pause")
    assert api.get(f"/v1/fine_tuning/jobs/{job.id}").json()["estimated_finish"] is None


def test_result_file_downloads_and_cannot_train(
    api: ApiClient, other_key: str, training_file: File, tiny: BaseModel
) -> None:
    job = FinetuneJob.objects.get(pk=create(api, training_file).json()["id"])
    finetune_job_start(job=job)
    JobMetric.objects.create(job=job, ts=timezone.now(), step=1, train_loss=2.0, train_accuracy=0.5)
    job = finetune_job_succeed(job=job, trained_tokens=10, adapter_path="adapters/x")
    result = job_result_file_create(job=job)
    body = api.get(f"/v1/fine_tuning/jobs/{job.id}").json()
    assert body["result_files"] == [result.id] and body["estimated_finish"] is None
    meta = api.get(f"/v1/files/{result.id}").json()
    assert meta["purpose"] == "fine-tune-results" and meta["filename"] == "step_metrics.csv"
    content = api.get(f"/v1/files/{result.id}/content")
    assert content.status_code == 200
    assert b"".join(content.streaming_content) == (
        b"step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy\n1,2.0,0.5,,\n"
    )
    listed = api.get("/v1/files?purpose=fine-tune-results").json()["data"]
    assert [f["id"] for f in listed] == [result.id]
    assert ApiClient(other_key).get(f"/v1/files/{result.id}/content").status_code == 404
    refused = create(api, result)
    assert_error(refused, 400, param="training_file")
    refused = create(api, training_file, validation_file=result.id)
    assert_error(refused, 400, param="validation_file")


def test_results_purpose_cannot_be_uploaded(api: ApiClient) -> None:
    response = api.upload(b'{"prompt": "a", "completion": "b"}\n', purpose="fine-tune-results")
    assert_error(response, 400, param="purpose")
