"""Switch this process's logging to production's JSON lines (config.logging) and read back the
lines written, parsed; the test settings' logging comes back after. Test modules wrap
:func:`captured_json_logs` in a `json_logs` fixture."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings

from config.logging import control_plane_logging

JsonLines = Callable[[], list[dict[str, Any]]]


@contextmanager
def captured_json_logs() -> Iterator[JsonLines]:
    logging.config.dictConfig(
        control_plane_logging(log_format="json", level="INFO", stream="ext://sys.stdout")
    )
    (handler,) = logging.getLogger().handlers
    assert isinstance(handler, logging.StreamHandler)
    buffer = io.StringIO()
    handler.setStream(buffer)

    def lines() -> list[dict[str, Any]]:
        handler.flush()
        return [json.loads(line) for line in buffer.getvalue().splitlines()]

    try:
        yield lines
    finally:
        logging.config.dictConfig(settings.LOGGING)
