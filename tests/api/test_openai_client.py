"""The official `openai` client, unchanged, against a live server."""

from __future__ import annotations

import openai
import pytest

from api.models import FinetuneJob
from api.services.apikeys import api_key_issue_for_tenant
from api.services.fleet import base_model_register
from api.services.jobs import finetune_job_start, job_checkpoint_record
from api.services.tenants import tenant_create
from tests.api.conftest import VALID_JSONL


@pytest.mark.django_db(transaction=True)
def test_openai_client_drives_files_jobs_checkpoints_models(live_server: object) -> None:
    base_model_register(name="tiny", preset="tiny")
    key = api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key
    client = openai.OpenAI(
        base_url=f"{live_server.url}/v1",  # type: ignore[attr-defined]
        api_key=key,
        max_retries=0,
        timeout=30,
    )

    uploaded = client.files.create(file=("train.jsonl", VALID_JSONL), purpose="fine-tune")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(VALID_JSONL)
    assert uploaded.status == "processed"
    with pytest.raises(openai.BadRequestError) as bad_file:
        client.files.create(file=("bad.jsonl", b'{"messages": 1}\n'), purpose="fine-tune")
    assert "line 1" in bad_file.value.message

    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=uploaded.id,
        suffix="demo",
        hyperparameters={"n_epochs": 3},
        extra_body={"lora": {"rank": 8}},
    )
    assert job.status == "queued" and job.model == "tiny"
    assert job.hyperparameters.n_epochs == 3 and job.hyperparameters.batch_size == "auto"
    second = client.fine_tuning.jobs.create(model="tiny", training_file=uploaded.id)

    listed = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in listed.data] == [second.id] and listed.has_more
    assert [j.id for j in listed.get_next_page().data] == [job.id]
    assert [j.id for j in client.fine_tuning.jobs.list(limit=1)] == [second.id, job.id]
    assert client.fine_tuning.jobs.retrieve(job.id).id == job.id

    started = finetune_job_start(job=FinetuneJob.objects.get(pk=job.id))
    job_checkpoint_record(job=started, step=5, metrics={"train_loss": 2.5})
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id)
    assert [c.step_number for c in checkpoints.data] == [5]
    assert checkpoints.data[0].metrics.train_loss == 2.5

    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    events = client.fine_tuning.jobs.list_events(job.id, limit=50)
    assert events.data[0].message == "Job cancelled"
    assert events.data[-1].message == f"Created fine-tuning job: {job.id}"
    assert all(e.object == "fine_tuning.job.event" for e in events.data)

    assert client.fine_tuning.jobs.pause(second.id).status == "paused"
    assert client.fine_tuning.jobs.resume(second.id).status == "queued"
    assert client.fine_tuning.jobs.cancel(second.id).status == "cancelled"
    assert [f.id for f in client.files.list()] == [uploaded.id]
    assert client.files.retrieve(uploaded.id).filename == "train.jsonl"
    assert client.files.content(uploaded.id).read() == VALID_JSONL
    assert client.files.delete(uploaded.id).deleted is True

    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-doesnotexist")
    with pytest.raises(openai.BadRequestError) as bad_model:
        client.fine_tuning.jobs.create(model="gpt-9", training_file=uploaded.id)
    assert bad_model.value.param == "model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{live_server.url}/v1",  # type: ignore[attr-defined]
            api_key="hk-wrong",
            max_retries=0,
        ).models.list()
