"""What a host reports about a failure reaches the tenant (the job's `error`, its events, the
API) without a storage key or a local path, whatever the host put in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.models import FinetuneJob, GpuHost, JobStatus
from api.services.reports import host_report_apply
from api.tenant_text import HIDDEN, without_locations
from gpu_runtime.contract.protocol import report
from tests.api.conftest import ApiClient
from tests.api.services.conftest import place_now, started_report


@pytest.mark.django_db
def test_a_failure_report_reaches_the_tenant_without_keys_or_paths(
    fleet: dict[str, GpuHost],
    job: FinetuneJob,
    storage_dir: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    from api.services.apikeys import api_key_issue_for_tenant

    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None
    host_report_apply(message=started_report(placement))
    key = job.training_file.storage_key
    leaky = (
        f"engine loop error: [Errno 2] No such file or directory: '{storage_dir / key}'; "
        f"cannot resume from {{'step': 2, 'storage_key': 'checkpoints/{job.id}/step-000002'}}"
    )
    failed = report("job_failed", "h2", placement_id=placement.pk, job_id=job.id,
                    code="host_error", message=leaky)  # fmt: skip
    assert host_report_apply(message=failed) == "applied"
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    api = ApiClient(api_key_issue_for_tenant(tenant=job.tenant).key)
    seen = [api.get(f"/v1/fine_tuning/jobs/{job.id}").content.decode()]
    seen.append(api.get(f"/v1/fine_tuning/jobs/{job.id}/events?limit=100").content.decode())
    seen.append(api.get(f"/v1/files/{job.training_file_id}").content.decode())
    for body in seen:
        for location in (key, str(storage_dir), "checkpoints/", "files/"):
            assert location not in body, body
    assert job.error is not None and job.error["message"] == (
        f"engine loop error: [Errno 2] No such file or directory: '{HIDDEN}'; "
        f"cannot resume from {{'step': 2, 'storage_key': '{HIDDEN}'}}"
    )


@pytest.mark.parametrize(
    "text",
    [
        "file file-abc, line 3: not valid JSON",
        "Step 3/10: 120 tokens/s on host agent-a",
        "see https://example.com/a/b/c for details",
        "ratio 1/2 of 4/8 blocks",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert without_locations(text) == text
