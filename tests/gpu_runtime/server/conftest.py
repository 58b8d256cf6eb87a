"""One torch thread for the server tests (the engine loop thread included)."""

from __future__ import annotations

from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401
