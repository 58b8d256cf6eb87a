"""`TokenClock`: token gaps, per-request TPOT and TTFT, and the running requests' view."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_runtime.colocation.token_clock import TokenClock
from gpu_runtime.colocation.types import MIN_TOKENS_FOR_TPOT
from gpu_runtime.engine.request import RequestOutput


def _out(request_id: str, tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id, [7] * tokens, [], "", finished, "length" if finished else None, 4
    )


def test_gaps_tpot_and_ttft_from_emission_times() -> None:
    clock = TokenClock()
    clock.start("a", arrival=1.0)
    samples, done = clock.time([_out("a", 1)], emitted=1.5)  # first token: TTFT, no gap
    assert samples == [] and done == []
    samples, _ = clock.time([_out("a", 2)], emitted=1.52)  # two tokens in one step: per token
    assert samples == [pytest.approx(10.0)]
    samples, done = clock.time([_out("a", 1, finished=True)], emitted=1.53)
    assert samples == [pytest.approx(10.0)]
    (finished,) = done
    assert finished.output_tokens == 4 and finished.finish_reason == "length"
    assert finished.tpot_ms == pytest.approx(30.0 / 3) and finished.ttft_ms == pytest.approx(500)
    assert clock.running() == []  # a finished request leaves the clock


def test_running_requests_need_enough_tokens_and_the_engine_to_know_them() -> None:
    clock = TokenClock()
    for request_id in ("long", "short", "aborted"):
        clock.start(request_id, arrival=0.0)
    for step in range(MIN_TOKENS_FOR_TPOT):
        outputs = [_out("long", 1), _out("aborted", 1)] + ([_out("short", 1)] if step < 3 else [])
        clock.time(outputs, emitted=0.01 * (step + 1))
    assert {r.request_id for r in clock.running()} == {"long", "aborted"}
    known = {"long": SimpleNamespace(request_id="long", fan_out=1,
                                     sampling_params=SimpleNamespace(max_tokens=40),
                                     output_token_ids=[0] * MIN_TOKENS_FOR_TPOT),
             "short": SimpleNamespace(request_id="short", fan_out=1,
                                      sampling_params=SimpleNamespace(max_tokens=8),
                                      output_token_ids=[0] * 3)}  # fmt: skip
    (view,) = clock.views(known)  # "aborted" is unknown to the engine: dropped
    assert view.tokens == MIN_TOKENS_FOR_TPOT and view.tpot_ms == pytest.approx(10.0)
    assert view.remaining_tokens == 40 - MIN_TOKENS_FOR_TPOT
    assert {r.request_id for r in clock.running()} == {"long"}
    assert clock.views(None)[0].remaining_tokens is None  # no engine view: limit unknown
