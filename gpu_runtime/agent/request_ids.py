"""Which request each job's reports answer: the `request_id` of the latest command a host got
for the job (`gpu_runtime.contract.protocol`), kept for the reports the engine loop sends
later (progress, checkpoints, the end). Loop thread only."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gpu_runtime.contract.request_id import valid_request_id

MAX_JOBS_REMEMBERED = 4096
"""Jobs whose request id is kept; the oldest is forgotten past this (a host trains a few)."""


def command_job_id(command: dict[str, Any]) -> str | None:
    """The job a host command is about, or None (adapter, base-model and drain commands)."""
    if command.get("command") == "apply_placement" and isinstance(command.get("job"), dict):
        job_id = command["job"].get("id")
    else:
        job_id = command.get("job_id")
    return job_id if isinstance(job_id, str) else None


class JobRequestIds:
    """Job id to the request id of the latest command about it (bounded, oldest out)."""

    def __init__(self, capacity: int = MAX_JOBS_REMEMBERED) -> None:
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity

    def remember(self, job_id: str, request_id: str | None) -> None:
        if valid_request_id(request_id) is None:
            return
        self._ids[job_id] = str(request_id)
        self._ids.move_to_end(job_id)
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def get(self, job_id: object) -> str | None:
        return self._ids.get(job_id) if isinstance(job_id, str) else None
