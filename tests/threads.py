"""Running one function on several threads at once, for the tests that race writers."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(target: Callable[[], None], count: int, *, timeout_s: float = 120) -> bool:
    """Start `count` threads running `target`, wait up to `timeout_s` for each, and return
    whether all of them ended (a thread still running means the race hung)."""
    threads = [threading.Thread(target=target) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    return not any(thread.is_alive() for thread in threads)
