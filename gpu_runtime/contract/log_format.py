"""How every Harli process writes its logs: one JSON object per line, or readable text.

JSON (production): `timestamp` (ISO 8601, UTC), `level`, `logger`, `message`, `request_id`,
`tenant`, `job_id` (null where unknown; see `gpu_runtime.contract.request_id`), `exception`
(the traceback, when there is one), and any `extra=` fields of the call. Text (a terminal, the
embedded platform): `time level logger [request id] message`, the traceback below.

The control plane's settings build their `LOGGING` with :func:`logging_config`; a host agent
calls :func:`configure_logging` (`--log-format`). Imports neither Django nor torch.
"""

from __future__ import annotations

import logging
import logging.config
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from gpu_runtime.contract.request_id import LOG_CONTEXT_FIELDS

LOG_FORMATS = ("json", "text")
_FILTER = "gpu_runtime.contract.request_id.LogContextFilter"
# Record attributes that are objects, not data (Django's `django.request` passes the request).
_NOT_LOGGED = ("request", "server_time", "color_message")


class JsonLogFormatter(JsonFormatter):
    """The JSON line of the module docstring."""

    def __init__(self) -> None:
        super().__init__(
            ["levelname", "name", "message", *LOG_CONTEXT_FIELDS],
            rename_fields={"levelname": "level", "name": "logger", "exc_info": "exception"},
            reserved_attrs=[*RESERVED_ATTRS, *_NOT_LOGGED],
            timestamp=True,
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_data["timestamp"] = None  # first in the line
        super().add_fields(log_data, record, message_dict)


class TextLogFormatter(logging.Formatter):
    """`time level logger [request id] message`; `-` for no request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None) is None:
            record.request_id = "-"
        return super().format(record)


def logging_config(
    *, log_format: str, level: str, stream: str = "ext://sys.stderr", loggers: list[str]
) -> dict[str, Any]:
    """A `logging.config.dictConfig` dict: one handler, on the root, writing to `stream` in
    `log_format`, every record given its request context; the root at WARNING, each of
    `loggers` at `level`. Every logger propagates to the root (handlers a library installed
    on the named loggers are removed), so one line format covers them all."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {list(LOG_FORMATS)}")
    formatter = JsonLogFormatter if log_format == "json" else TextLogFormatter
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": _FILTER}},
        "formatters": {"harli": {"()": f"{formatter.__module__}.{formatter.__qualname__}"}},
        "handlers": {
            "harli": {
                "class": "logging.StreamHandler",
                "stream": stream,
                "formatter": "harli",
                "filters": ["context"],
            }
        },
        "root": {"handlers": ["harli"], "level": "WARNING"},
        "loggers": {name: {"level": level, "propagate": True} for name in loggers},
    }


def configure_logging(*, log_format: str, level: str, loggers: list[str]) -> None:
    """Install :func:`logging_config` in this process (stderr)."""
    logging.config.dictConfig(logging_config(log_format=log_format, level=level, loggers=loggers))
