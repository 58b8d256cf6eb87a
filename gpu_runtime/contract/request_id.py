"""Request ids: the id one client request carries through every process it causes.

The web process takes a client's `X-Request-Id` when it is a valid one (:func:`valid_request_id`:
at most :data:`MAX_REQUEST_ID_LENGTH` characters, letters, digits and `._:-`) and makes one
otherwise (:func:`new_request_id`); it answers with it in `x-request-id`. From there it travels:

* web to worker: in the Celery message header :data:`CELERY_HEADER` of every task a request
  queues (`workers.request_ids`, Celery's publish and prerun signals);
* control plane to host: in a command's `request_id` field (`gpu_runtime.contract.protocol`);
  the agent logs its handling of the command under it and puts it on its reports about that job;
* host to worker: in a report's `request_id` field, which the worker's intake logs under;
* gateway to host: in the inference request's `x-request-id` header.

What a process knows of the request it works for (its id, the tenant, the job) is its
:class:`LogContext`, held in a context variable (one per thread and per asyncio task, so
concurrent requests never mix) and added to every log record by :class:`LogContextFilter`.
This module imports neither Django nor torch: the control plane and the hosts share it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass, replace
from typing import Any

REQUEST_ID_HEADER = "x-request-id"
"""The HTTP header, both ways (a client's own id in, the id used out), as OpenAI names it."""
CELERY_HEADER = "harli_request_id"
"""The Celery message header a task inherits its request id by."""
MAX_REQUEST_ID_LENGTH = 128
_VALID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_LENGTH}}}")


def valid_request_id(value: object) -> str | None:
    """`value` when it is a usable request id (a string of 1 to 128 letters, digits, `.`, `_`,
    `:` or `-`: nothing a log line, a header or a shell could misread), else None."""
    if isinstance(value, str) and _VALID.fullmatch(value):
        return value
    return None


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def request_id_or_new(value: object) -> str:
    """A client's id when valid, else a fresh one."""
    return valid_request_id(value) or new_request_id()


@dataclass(frozen=True)
class LogContext:
    """What every log record of the current request, task or command names (None: unknown)."""

    request_id: str | None = None
    tenant: str | None = None
    job_id: str | None = None


LOG_CONTEXT_FIELDS = ("request_id", "tenant", "job_id")
_NO_CONTEXT = LogContext()
_context: ContextVar[LogContext | None] = ContextVar("harli_log_context", default=None)


def log_context() -> LogContext:
    return _context.get() or _NO_CONTEXT


def current_request_id() -> str | None:
    return log_context().request_id


def bind_log_context(**fields: str | None) -> Token[LogContext | None]:
    """Add `fields` (those not None) to the current context until the token is reset, or until
    the enclosing :func:`bound_log_context` ends."""
    given = {key: value for key, value in fields.items() if value is not None}
    return _context.set(replace(log_context(), **given))


def reset_log_context(token: Token[LogContext | None]) -> None:
    """Restore the context as it was before the :func:`bind_log_context` that gave `token`
    (and every bind made since)."""
    _context.reset(token)


@contextlib.contextmanager
def bound_log_context(**fields: str | None) -> Iterator[LogContext]:
    """Within the block, the current context plus `fields` (those not None); restored after."""
    token = bind_log_context(**fields)
    try:
        yield log_context()
    finally:
        reset_log_context(token)


class LogContextFilter(logging.Filter):
    """Puts the current :class:`LogContext` on each record (`request_id`, `tenant`, `job_id`)
    unless the record already carries one (`extra=`). Attach it to handlers: a handler's
    filters see records of every logger that propagates to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = log_context()
        for field in LOG_CONTEXT_FIELDS:
            if getattr(record, field, None) is None:
                setattr(record, field, getattr(context, field))
        return True


def context_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {field: getattr(record, field, None) for field in LOG_CONTEXT_FIELDS}
