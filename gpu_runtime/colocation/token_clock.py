"""`TokenClock`: when each request's tokens came out, for TPOT samples, per-request TPOT and TTFT.

The host loop starts a request's clock when it queues it, hands every step's outputs with the
time they were emitted, and asks for the requests still decoding (their TPOT so far, for the
policy's projections and for figures over a window that ends before they finish).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpu_runtime.colocation.types import MIN_TOKENS_FOR_TPOT, FinishedRequest, RunningRequest
from gpu_runtime.engine import RequestOutput
from gpu_runtime.engine.fanout import sequence_ids


@dataclass
class _RequestTiming:
    arrival: float | None
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def tpot_so_far_ms(self) -> float | None:
        """Mean gap between its tokens so far (None below ``MIN_TOKENS_FOR_TPOT`` tokens)."""
        if self.tokens < MIN_TOKENS_FOR_TPOT or self.first is None or self.last is None:
            return None
        return (self.last - self.first) * 1e3 / (self.tokens - 1)

    def ttft_ms(self) -> float | None:
        if self.arrival is None or self.first is None:
            return None
        return (self.first - self.arrival) * 1e3


class TokenClock:
    """Per-request token timing (seconds of the loop's clock)."""

    def __init__(self) -> None:
        self._timing: dict[str, _RequestTiming] = {}

    def start(self, request_id: str, arrival: float) -> None:
        self._timing[request_id] = _RequestTiming(arrival)

    def forget(self, request_id: str) -> None:
        self._timing.pop(request_id, None)

    def time(
        self, outputs: list[RequestOutput], emitted: float
    ) -> tuple[list[float], list[FinishedRequest]]:
        """The gap since each output's previous token (per token when a step emits several)
        and the requests that finished, with their mean TPOT and TTFT."""
        samples: list[float] = []
        finished: list[FinishedRequest] = []
        for out in outputs:
            timing = self._timing.setdefault(out.request_id, _RequestTiming(None))
            count = len(out.new_token_ids)
            if timing.first is None:
                timing.first = emitted
            elif timing.last is not None and count:
                samples.append((emitted - timing.last) * 1e3 / count)
            timing.last = emitted
            timing.tokens += count
            if out.finished:
                self._timing.pop(out.request_id, None)
                tpot = None
                if timing.tokens > 1 and timing.first is not None:
                    tpot = (emitted - timing.first) * 1e3 / (timing.tokens - 1)
                finished.append(
                    FinishedRequest(
                        out.request_id, timing.tokens, tpot, timing.ttft_ms(), out.finish_reason
                    )
                )
        return samples, finished

    def running(self) -> list[FinishedRequest]:
        """Requests still decoding with at least ``MIN_TOKENS_FOR_TPOT`` tokens, their mean
        TPOT so far (``finish_reason`` "running")."""
        out = []
        for request_id, timing in self._timing.items():
            tpot = timing.tpot_so_far_ms()
            if tpot is not None:
                ttft = timing.ttft_ms()
                out.append(FinishedRequest(request_id, timing.tokens, tpot, ttft, "running"))
        return out

    def views(self, known: Mapping[str, Any] | None) -> tuple[RunningRequest, ...]:
        """What the policy sees of the running requests: TPOT so far and the tokens
        ``max_tokens`` still allows (from the engine's ``known`` requests; requests it no
        longer knows, aborted behind the loop's back, are dropped; a fan-out parent not forked
        yet stands for its children's)."""
        if known is not None:
            live = set(known)
            for request in known.values():
                if request.fan_out > 1:
                    live.update(sequence_ids(request.request_id, request.fan_out))
            for request_id in [r for r in self._timing if r not in live]:
                del self._timing[request_id]
        out = []
        for request_id, timing in self._timing.items():
            tpot = timing.tpot_so_far_ms()
            if tpot is None:
                continue
            request = None if known is None else known.get(request_id)
            remaining = None
            if request is not None:
                limit = request.sampling_params.max_tokens
                remaining = max(limit - len(request.output_token_ids), 0)
            out.append(RunningRequest(timing.tokens, tpot, remaining))
        return tuple(out)
