"""Per-request latency records (TTFT, TPOT) kept for the host agent to collect."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one finished request, in seconds."""

    request_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    """Arrival at the server to the first generated token."""
    tpot_s: float | None
    """Mean time per output token after the first; None with fewer than two tokens."""
    e2e_s: float
    finish_reason: str | None


class MetricsCollector:
    """Thread-safe bounded store of `RequestMetrics`; `drain()` hands them to a collector."""

    def __init__(self, max_records: int = 10000) -> None:
        self._records: deque[RequestMetrics] = deque(maxlen=max_records)
        self._lock = threading.Lock()

    def record(self, metrics: RequestMetrics) -> None:
        """Store one finished request."""
        with self._lock:
            self._records.append(metrics)

    def snapshot(self) -> list[RequestMetrics]:
        """Records held now (oldest first), left in place."""
        with self._lock:
            return list(self._records)

    def drain(self) -> list[RequestMetrics]:
        """Records held now, removed."""
        with self._lock:
            out = list(self._records)
            self._records.clear()
            return out
