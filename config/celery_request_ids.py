"""Request ids across Celery: a task inherits the id of the request (or task) that queued it.

Connected to Celery's signals when `config.celery` is imported, in every process:

* `before_task_publish`: the publishing context's request id goes into the message header
  `gpu_runtime.contract.request_id.CELERY_HEADER` (a task queued by `POST
  /v1/fine_tuning/jobs` carries that request's id).
* `task_prerun` / `task_postrun`: the task's start is logged (logger `harli.tasks`: INFO for
  a task a request queued, DEBUG for the beat's and the hosts' reports), and its log lines carry
  that header's id, else (a task run inline, under eager settings) the caller's, else the
  task's own id (a beat task); and the job it is about: a host report's `job_id` and
  `request_id` (the command the host answers), or a job id passed as the first argument.
* `setup_logging`: the worker keeps Django's `LOGGING` (config.logging) instead of Celery's own
  format, so its lines are JSON in production like the web's.
"""

from __future__ import annotations

import logging
import logging.config
from typing import Any

from celery import signals

from gpu_runtime.contract.request_id import (
    CELERY_HEADER,
    bind_log_context,
    current_request_id,
    reset_log_context,
    valid_request_id,
)

logger = logging.getLogger("harli.tasks")
JOB_ID_PREFIX = "ftjob-"
_TOKEN = "_harli_log_context_token"


@signals.before_task_publish.connect
def _publish_request_id(headers: dict[str, Any] | None = None, **_: Any) -> None:
    request_id = current_request_id()
    if headers is not None and request_id is not None:
        headers.setdefault(CELERY_HEADER, request_id)


def _task_context(task: Any, task_id: str, args: Any) -> dict[str, str | None]:
    request_id = _inherited_request_id(task)
    job_id = None
    first = args[0] if isinstance(args, list | tuple) and args else None
    if isinstance(first, dict):  # a host report
        request_id = valid_request_id(first.get("request_id")) or request_id
        job_id = first.get("job_id") if isinstance(first.get("job_id"), str) else None
    elif isinstance(first, str) and first.startswith(JOB_ID_PREFIX):
        job_id = first
    return {
        "request_id": request_id or current_request_id() or valid_request_id(task_id),
        "job_id": job_id,
    }


def _inherited_request_id(task: Any) -> str | None:
    """The header's id: a worker's request has the message's headers as attributes; a task run
    with `apply(headers=...)` (inline) has them in `request.headers`."""
    headers = getattr(task.request, "headers", None)
    inline = headers.get(CELERY_HEADER) if isinstance(headers, dict) else None
    return valid_request_id(getattr(task.request, CELERY_HEADER, None) or inline)


@signals.task_prerun.connect
def _bind_task_context(task_id: str = "", task: Any = None, args: Any = None, **_: Any) -> None:
    if task is None:
        return
    setattr(task.request, _TOKEN, bind_log_context(**_task_context(task, task_id, args)))
    level = logging.INFO if _inherited_request_id(task) else logging.DEBUG
    logger.log(level, "task %s %s started", task.name, task_id, extra={"task": task.name})


@signals.task_postrun.connect
def _unbind_task_context(task: Any = None, **_: Any) -> None:
    token = getattr(task.request, _TOKEN, None) if task is not None else None
    if token is not None:
        setattr(task.request, _TOKEN, None)
        try:
            reset_log_context(token)
        except ValueError:  # bound in another context (a task run inline in a worker thread)
            pass


@signals.setup_logging.connect
def _keep_django_logging(**_: Any) -> None:
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
