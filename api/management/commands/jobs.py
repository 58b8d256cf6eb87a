"""`manage.py jobs list [--tenant T] [--status S] | cancel JOB_ID`."""

from __future__ import annotations

from typing import Any

from api.management.base import NounCommand
from api.models import JobStatus
from api.selectors import finetune_job_get, finetune_job_list, tenant_get
from api.services.jobs import finetune_job_cancel


class Command(NounCommand):
    help = "List fine-tuning jobs of every tenant, and cancel them."

    def add_actions(self, subparsers: Any) -> None:
        listing = subparsers.add_parser("list", help="list jobs, newest first")
        listing.add_argument("--tenant", help="only this tenant's jobs")
        listing.add_argument("--status", choices=JobStatus.values)
        listing.add_argument("--limit", type=int, default=50)
        cancel = subparsers.add_parser("cancel", help="cancel a job")
        cancel.add_argument("job_id", help="ftjob-...")

    def action_list(self, *, tenant: str | None, status: str | None, limit: int, **_: Any) -> None:
        jobs = finetune_job_list(tenant=tenant_get(name=tenant) if tenant else None, status=status)[
            : max(limit, 0)
        ]
        rows = [
            (
                j.id,
                j.tenant.name,
                j.base_model.name,
                j.status,
                j.fine_tuned_model,
                j.created_at.isoformat(timespec="seconds"),
            )
            for j in jobs
        ]
        self.table(["ID", "TENANT", "MODEL", "STATUS", "FINE-TUNED MODEL", "CREATED"], rows)

    def action_cancel(self, *, job_id: str, **_: Any) -> None:
        job = finetune_job_cancel(job=finetune_job_get(tenant=None, job_id=job_id))
        self.stdout.write(f"Job {job.id} is {job.status}.")
