"""Which host serves an inference request: a pure ranking over what hosts report.

Among the hosts that serve the request's base model (the caller keeps only online, non-draining
ones that heartbeat), the order is:

1. hosts meeting their deployment's SLO attainment target before hosts under it (a host under
   target gets new requests only when no other can take them);
2. hosts that serve the requested model (the base model, or an adapter the host reports)
   before hosts that do not report it (they may have loaded it since their last heartbeat);
3. hosts with room (no waiting request and a free KV page) before saturated ones;
4. hosts where the adapter is resident in a GPU slot (no load before the first token);
5. the least loaded: running plus waiting requests as reported, or this gateway's own open
   requests to the host when it knows of more (a heartbeat is up to an interval old);
6. more free KV pages, then more TPOT headroom against the SLO, then the name (a stable order).

A host this gateway failed to reach moments ago ranks after every other (`ejected`).
Each choice carries the reason it was ranked where it was, for the routing log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostCandidate:
    """One host as the gateway sees it (from its latest heartbeat)."""

    name: str
    base_model: str
    server_url: str
    adapters: frozenset[str] = frozenset()
    resident_adapters: frozenset[str] = frozenset()
    running: int = 0
    waiting: int = 0
    kv_free_pages: int | None = None
    kv_total_pages: int | None = None
    tpot_p50_ms: float | None = None
    tpot_slo_ms: float | None = None
    slo_attainment: float | None = None
    """Fraction of recent decode iterations within the TPOT SLO (None: none ran)."""
    attainment_target: float = 0.0
    """The deployment's target, as a fraction."""

    def serves(self, model: str) -> bool:
        return model == self.base_model or model in self.adapters

    def resident(self, model: str) -> bool:
        return model == self.base_model or model in self.resident_adapters

    def under_target(self) -> bool:
        return self.slo_attainment is not None and self.slo_attainment < self.attainment_target

    def saturated(self) -> bool:
        return self.waiting > 0 or self.kv_free_pages == 0

    def kv_free_fraction(self) -> float:
        if not self.kv_total_pages or self.kv_free_pages is None:
            return 1.0
        return self.kv_free_pages / self.kv_total_pages

    def tpot_ratio(self) -> float:
        if self.tpot_p50_ms is None or not self.tpot_slo_ms:
            return 0.0
        return self.tpot_p50_ms / self.tpot_slo_ms


@dataclass(frozen=True)
class RouteChoice:
    host: HostCandidate
    reason: str
    load: int = field(compare=False, default=0)


def rank_hosts(
    hosts: Sequence[HostCandidate],
    *,
    base_model: str,
    model: str,
    open_requests: Mapping[str, int],
    ejected: frozenset[str] = frozenset(),
) -> list[RouteChoice]:
    """The hosts that can serve `model` (of `base_model`), best first (see the module
    docstring). `open_requests` counts this gateway's requests in flight per host name."""
    candidates = [h for h in hosts if h.base_model == base_model]

    def load(host: HostCandidate) -> int:
        return max(host.running + host.waiting, open_requests.get(host.name, 0))

    def key(host: HostCandidate) -> tuple[bool, bool, bool, bool, bool, int, float, float, str]:
        return (
            host.name in ejected,
            host.under_target(),
            not host.serves(model),
            host.saturated(),
            not host.resident(model),
            load(host),
            -host.kv_free_fraction(),
            host.tpot_ratio(),
            host.name,
        )

    ranked = sorted(candidates, key=key)
    return [RouteChoice(h, _reason(h, model, load(h), ejected), load(h)) for h in ranked]


def _reason(host: HostCandidate, model: str, load: int, ejected: frozenset[str]) -> str:
    parts = []
    if host.name in ejected:
        parts.append("unreachable moments ago")
    if host.under_target():
        parts.append(
            f"attainment {host.slo_attainment:.3f} under target {host.attainment_target:.3f}"
        )
    if not host.serves(model):
        parts.append("does not report the model")
    elif host.resident(model):
        parts.append("model resident" if model != host.base_model else "base model")
    else:
        parts.append("adapter served, not resident")
    if host.saturated():
        parts.append("saturated")
    parts.append(f"load {load}")
    if host.kv_free_pages is not None:
        parts.append(f"kv free {host.kv_free_pages}/{host.kv_total_pages}")
    if host.tpot_p50_ms is not None:
        parts.append(f"tpot p50 {host.tpot_p50_ms:.1f} ms")
    return "; ".join(parts)
