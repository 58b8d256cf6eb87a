"""A DPO job's checkpoint report with validation metrics, as a host sends it, reaches the API's
checkpoint `metrics`, the checkpoint event and the step's metrics row (its `valid_loss`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.models import FinetuneJob, JobCheckpoint, JobMetric, Tenant
from api.serializers import JobCheckpointSerializer
from api.services.files import UploadSource, file_create
from api.services.jobs import finetune_job_create
from api.services.placement import job_place
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import PREFERENCE_METRICS, checkpoint_key, report
from tests.api.services.conftest import drain_host_queue, heartbeat, make_host

pytestmark = pytest.mark.django_db
PAIR = {
    "input": {"messages": [{"role": "user", "content": "Capital of France?"}]},
    "preferred_output": [{"role": "assistant", "content": "Paris."}],
    "non_preferred_output": [{"role": "assistant", "content": "Lyon."}],
}
PREFERENCES = (json.dumps(PAIR) + "\n").encode() * 4
TRAIN = {"train_preference_accuracy": 0.5, "train_chosen_reward": 0.25,
         "train_rejected_reward": -0.25, "train_reward_margin": 0.5}  # fmt: skip


def test_dpo_validation_metrics_reach_the_checkpoint_and_the_step(
    tenant: Tenant, deployment: Any, django_capture_on_commit_callbacks: Any
) -> None:
    files = [
        file_create(
            tenant=tenant,
            purpose="fine-tune",
            upload=UploadSource.from_bytes(filename=name, data=PREFERENCES),
        )
        for name in ("train.jsonl", "valid.jsonl")
    ]
    with django_capture_on_commit_callbacks(execute=False):
        job = finetune_job_create(
            tenant=tenant,
            model="tiny",
            training_file=files[0].id,
            validation_file=files[1].id,
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},
        )
    make_host("h1", deployment)
    heartbeat("h1", harvestable_tokens_per_s=100.0)
    with django_capture_on_commit_callbacks(execute=True):
        placement = job_place(job_id=job.id)
    assert placement is not None
    (command,) = [c for c in drain_host_queue("h1") if c["command"] == "apply_placement"]
    assert command["job"]["validation_file_key"] == files[1].storage_key
    ids = {"placement_id": placement.pk, "job_id": job.id}

    def send(kind: str, **fields: Any) -> str:
        return host_report_apply(message=report(kind, "h1", **ids, **fields))

    assert send("job_progress", step=2, total_steps=4, train_loss=0.6, train_accuracy=None,
                tokens_per_s=10.0, trained_tokens=80, **TRAIN) == "applied"  # fmt: skip
    metrics = {
        "train_loss": 0.6,
        "train_mean_token_accuracy": None,
        "valid_loss": 0.65,
        "valid_mean_token_accuracy": None,
        "full_valid_loss": None,
        "full_valid_mean_token_accuracy": None,
        "valid_preference_accuracy": 0.75,
        "full_valid_preference_accuracy": None,
        **TRAIN,
    }
    with django_capture_on_commit_callbacks(execute=True):
        key = checkpoint_key(job.id, 2)
        assert send("checkpoint", step=2, storage_key=key, metrics=metrics) == "applied"
    body = JobCheckpointSerializer(JobCheckpoint.objects.get(job=job, step=2)).data
    assert body["metrics"] == {"step": 2, **metrics}
    assert set(PREFERENCE_METRICS) <= set(body["metrics"])
    row = JobMetric.objects.get(job=job, step=2)
    assert (row.valid_loss, row.valid_mean_token_accuracy) == (0.65, None)
    event = FinetuneJob.objects.get(pk=job.pk).events.get(message="Checkpoint saved at step 2")
    data = dict(event.data or {})
    assert (data["valid_loss"], data["valid_preference_accuracy"]) == (0.65, 0.75)
