"""Run an ASGI app under uvicorn on a free loopback port in a thread, for the server tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpu_runtime.server.threaded import ThreadedServer


@contextmanager
def serve_in_thread(app: Any, start_timeout_s: float = 20.0) -> Iterator[str]:
    """Yield the app's `/v1` base URL while uvicorn serves it; stop the server on exit."""
    server = ThreadedServer(app)
    server.start(start_timeout_s)
    try:
        yield server.url
    finally:
        server.stop(10)
