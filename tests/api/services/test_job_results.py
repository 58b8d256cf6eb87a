"""What hosts measure reaches the job: resolved settings, live trained tokens, token accuracy and
validation loss per step, the kept checkpoints (older ones deleted from storage), and the
results CSV of a finished job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.models import File, FinetuneJob, JobCheckpoint, JobMetric, Placement
from api.serializers import FineTuningJobSerializer
from api.services.files import file_content_chunks
from api.services.placement import job_place
from api.services.placement_dispatch import placement_command
from api.services.reports import host_report_apply
from api.storage import get_storage
from gpu_runtime.contract.protocol import ProtocolError, checkpoint_key, report
from tests.api.services.conftest import drain_host_queue, heartbeat, make_host

pytestmark = pytest.mark.django_db
RESOLVED = {"n_epochs": 3, "batch_size": 1, "learning_rate_multiplier": 1.0}


@pytest.fixture
def placement(deployment: Any, job: FinetuneJob, django_capture_on_commit_callbacks: Any) -> Any:
    make_host("h1", deployment)
    heartbeat("h1", harvestable_tokens_per_s=100.0)
    with django_capture_on_commit_callbacks(execute=True):
        placed = job_place(job_id=job.id)
    drain_host_queue("h1")
    assert placed is not None
    return placed


def _send(placement: Placement, kind: str, **fields: Any) -> str:
    ids = {"placement_id": placement.pk, "job_id": placement.job_id}
    return host_report_apply(message=report(kind, "h1", **ids, **fields))


def _progress(placement: Placement, step: int, **extra: Any) -> str:
    return _send(placement, "job_progress", step=step, total_steps=12, train_loss=3.0 - step / 10,
                 train_accuracy=step / 100, tokens_per_s=10.0, trained_tokens=40 * step,
                 **extra)  # fmt: skip


def _store_tree(tmp_path: Path, key: str) -> None:
    local = tmp_path / key.replace("/", "_")
    local.mkdir()
    (local / "adapter_model.safetensors").write_bytes(b"weights")
    get_storage().put_tree(key, local)


def test_started_progress_and_checkpoints_fill_the_job(
    placement: Placement,
    job: FinetuneJob,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setenv("HARLI_KEEP_CHECKPOINTS", "2")
    assert _send(placement, "job_started", resumed_from_step=0, total_steps=12,
                 hyperparameters=RESOLVED) == "applied"  # fmt: skip
    job.refresh_from_db()
    assert job.hyperparameters["n_epochs"] == "auto"  # what was asked stays
    assert (job.resolved_hyperparameters, job.total_steps) == (RESOLVED, 12)
    body = FineTuningJobSerializer(job).data
    assert body["hyperparameters"] == RESOLVED
    assert body["method"]["supervised"]["hyperparameters"] == RESOLVED
    for step in range(1, 9):
        valid = {"valid_loss": 2.0, "valid_mean_token_accuracy": 0.25} if step % 2 == 0 else {}
        assert _progress(placement, step, **valid) == "applied"
        job.refresh_from_db()
        assert job.trained_tokens == 40 * step  # live, not only at the end
        if step % 2 == 0:
            key = checkpoint_key(job.id, step)
            _store_tree(tmp_path, key)
            metrics = {"train_loss": 3.0 - step / 10, "valid_loss": 2.0, "full_valid_loss": None}
            with django_capture_on_commit_callbacks(execute=True):
                assert _send(placement, "checkpoint", step=step, storage_key=key,
                             metrics=metrics) == "applied"  # fmt: skip
    row = JobMetric.objects.get(job=job, step=4)
    assert (row.train_accuracy, row.valid_loss, row.valid_mean_token_accuracy) == (0.04, 2.0, 0.25)
    event = job.events.get(message="Step 4/12: training loss=2.6000, validation loss=2.0000")
    data = dict(event.data or {})
    assert data["valid_loss"] == 2.0 and data["train_mean_token_accuracy"] == 0.04
    # the two latest checkpoints stay; the others left the list and storage
    assert list(JobCheckpoint.objects.filter(job=job).values_list("step", flat=True)) == [8, 6]
    storage = get_storage()
    for step in (2, 4):
        assert storage.list_keys(checkpoint_key(job.id, step)) == []
    assert storage.exists(f"{checkpoint_key(job.id, 8)}/.complete")
    # a resumed placement continues from the latest kept checkpoint
    resume = placement_command(placement=placement)["job"]["resume_from"]
    assert resume == {"step": 8, "storage_key": checkpoint_key(job.id, 8)}


def test_success_writes_the_results_csv_as_a_tenant_file(
    placement: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    _send(placement, "job_started", resumed_from_step=0, total_steps=3, hyperparameters=RESOLVED)
    _progress(placement, 1)
    _progress(placement, 2, valid_loss=1.5, valid_mean_token_accuracy=0.5)
    # step 3's progress was lost: the checkpoint report recovers it
    recent = [{"step": 3, "train_loss": 2.5, "learning_rate": 1e-4, "train_accuracy": 0.75}]
    metrics = {"train_loss": 2.5, "valid_loss": 1.25, "valid_mean_token_accuracy": 0.5}
    _send(placement, "checkpoint", step=3, storage_key=checkpoint_key(job.id, 3),
          recent_steps=recent, metrics=metrics)  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        assert _send(placement, "job_succeeded", trained_tokens=120,
                     adapter_key=f"adapters/{job.id}") == "applied"  # fmt: skip
    job.refresh_from_db()
    (file,) = File.objects.filter(job=job)
    assert (file.tenant_id, file.purpose, file.filename) == (
        job.tenant_id,
        "fine-tune-results",
        "step_metrics.csv",
    )
    text = b"".join(file_content_chunks(file=file)).decode()
    assert text == (
        "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy\n"
        "1,2.9,0.01,,\n"
        "2,2.8,0.02,1.5,0.5\n"
        "3,2.5,0.75,1.25,0.5\n"
    )
    assert file.bytes == len(text.encode())
    assert FineTuningJobSerializer(job).data["result_files"] == [file.id]


def test_a_bad_resolved_report_is_dropped_as_malformed(
    placement: Placement, job: FinetuneJob
) -> None:
    with pytest.raises(ProtocolError, match="n_epochs"):
        _send(placement, "job_started", resumed_from_step=0, total_steps=3,
              hyperparameters={"n_epochs": "auto", "batch_size": 1,
                               "learning_rate_multiplier": 1.0})  # fmt: skip
    job.refresh_from_db()
    assert job.resolved_hyperparameters is None and job.status == "queued"


def test_nothing_is_pruned_while_a_placement_is_pending(
    placement: Placement, job: FinetuneJob
) -> None:
    from api.services.job_results import job_checkpoints_prune
    from api.services.jobs import job_checkpoint_record

    for step in (1, 2, 3):
        job_checkpoint_record(job=job, step=step, metrics={}, path=checkpoint_key(job.id, step))
    assert placement.state == "pending"  # sent, its host has not loaded its checkpoint yet
    assert job_checkpoints_prune(job=job, keep=1) == []
    assert JobCheckpoint.objects.filter(job=job).count() == 3
    Placement.objects.filter(pk=placement.pk).update(state="active")
    assert job_checkpoints_prune(job=job, keep=1) == [1, 2]
    assert list(JobCheckpoint.objects.filter(job=job).values_list("step", flat=True)) == [3]
