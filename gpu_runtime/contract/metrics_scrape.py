"""What every `/metrics` of the platform shares (web, workers, hosts): the bearer check of a
scrape, and a process's samples in Prometheus' text format."""

from __future__ import annotations

import hmac

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries `Bearer <token>` (constant-time)."""
    scheme, _, sent = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode())


def process_exposition(multiproc_dir: str | None) -> bytes:
    """This process's default-registry samples; with `multiproc_dir` (prometheus-client's
    multiprocess mode) the sum over every process writing there instead."""
    if multiproc_dir:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, multiproc_dir)
        return generate_latest(registry)
    return generate_latest(REGISTRY)
