"""The finetune job lifecycle: every legal status change, in one table.

OpenAI's lifecycle `validating_files -> queued -> running -> succeeded | failed | cancelled`, plus
`paused` (a tenant's pause; `resume` goes back to `queued` so the job is placed again) and
`running -> queued` (the host was lost; the job resumes from its last checkpoint elsewhere).
`api.services.jobs.finetune_job_transition` is the only writer of `FinetuneJob.status`.
"""

from __future__ import annotations

from api.models.finetune import JobStatus

TERMINAL_STATUSES: frozenset[str] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}
)

JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    JobStatus.VALIDATING_FILES: frozenset(
        {JobStatus.QUEUED, JobStatus.FAILED, JobStatus.CANCELLED}
    ),
    JobStatus.QUEUED: frozenset(
        {JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.FAILED, JobStatus.CANCELLED}
    ),
    JobStatus.RUNNING: frozenset(
        {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
            JobStatus.PAUSED,
            JobStatus.QUEUED,
        }
    ),
    JobStatus.PAUSED: frozenset({JobStatus.QUEUED, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


def is_legal_transition(current: str, target: str) -> bool:
    """True when a job in status `current` may move to `target`. Unknown statuses are illegal."""
    return target in JOB_TRANSITIONS.get(current, frozenset())
