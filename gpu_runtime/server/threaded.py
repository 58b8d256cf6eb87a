"""uvicorn serving an ASGI app in a daemon thread (the host agent; the server tests)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ThreadedServer:
    """`start()` returns once uvicorn accepts connections; `stop()` lets it finish open
    responses for up to `timeout` seconds. Port 0 picks a free port (see `port`). uvicorn
    keeps the process's logging configuration (its warnings and errors go through the same
    handlers as every other line) and writes no access log (`request_ids` writes one)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", log_config=None, access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="inference-http", daemon=True)

    @property
    def url(self) -> str:
        """The `/v1` base URL clients use."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the inference server did not start on {self.host}:{self.port}")
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
