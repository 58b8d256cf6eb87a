"""The control plane's `LOGGING` (web, worker, beat): `gpu_runtime.contract.log_format` over
one stream, every line carrying its request id (`gpu_runtime.contract.request_id`).

HARLI_LOG_FORMAT chooses `json` (one object per line; production's default, on stdout) or
`text` (readable; the default elsewhere, on stderr). The platform's loggers (`harli.*`, `api`,
`workers`, `console`, `gpu_runtime`) log from HARLI_LOG_LEVEL up (a task's start under
`harli.tasks`), every other module's (Celery's among them) from WARNING; uvicorn's errors go
through the same handler (its access log is replaced by `harli.request`'s line), and so do
Django's (without the second, bare copy its DEBUG console handler would print).
"""

from __future__ import annotations

from typing import Any

from config.env import EnvError
from gpu_runtime.contract.log_format import LOG_FORMATS, logging_config

PLATFORM_LOGGERS = ("harli", "api", "workers", "console", "gpu_runtime")


def control_plane_logging(*, log_format: str, level: str, stream: str) -> dict[str, Any]:
    """The `LOGGING` dict (see the module docstring)."""
    if log_format not in LOG_FORMATS:
        raise EnvError(f"HARLI_LOG_FORMAT={log_format!r} is not one of {list(LOG_FORMATS)}")
    config = logging_config(
        log_format=log_format, level=level, stream=stream, loggers=list(PLATFORM_LOGGERS)
    )
    config["loggers"] |= {
        name: {"level": level, "propagate": True}
        for name, level in (("uvicorn", "INFO"), ("uvicorn.error", "INFO"),
                            ("uvicorn.access", "WARNING"), ("django", "WARNING"))
    }  # fmt: skip
    return config
