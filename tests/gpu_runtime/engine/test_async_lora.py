"""Async scheduling (`EngineConfig.async_scheduling`) with LoRA adapter requests, on CPU (fp32,
the bucketed decode path running the LoRA forward eagerly over the static buffers).

With every request queued before the first step the async engine runs the synchronous engine's
steps, so tokens and logprobs must be equal, adapter rows beside base rows; with arrivals, stop
tokens, stop strings, aborts and slot contention, the tokens must still be the synchronous
engine's (and, greedy, those of each adapter's merged-weights model), slots must be released
exactly once and the engine must end with no runner state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model.loader import load_tokenizer
from gpu_runtime.model.tiny import build_tiny_tokenizer
from tests.gpu_runtime.engine.test_lora import (
    GREEDY,
    _base,
    _expected,
    _held_slots,
    _prompts,
    write_adapters,
)

NAMES: list[str | None] = [None, "support-bot", "poet", None, "coder", "support-bot", "poet"]
SEEDED = SamplingParams(
    max_tokens=10, temperature=0.9, top_k=40, seed=11, logprobs=2, detokenize=False
)
Arrival = tuple[int, list[int], str | None]
"""(call index before which the request is added, prompt, adapter or None)."""
Result = tuple[list[int], list[Any], str | None]
"""Per request: tokens, logprobs (token id, logprob, top), finish reason."""


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_adapters(tmp_path_factory.mktemp("async-adapters"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("async-tokenizer")
    build_tiny_tokenizer(directory)
    return load_tokenizer(directory)


def _engine(
    adapter_dirs: dict[str, Path],
    asynchronous: bool,
    num_slots: int = 3,
    tokenizer: Any = None,
    max_rank: int = 8,
    **overrides: object,
) -> tuple[Engine, MultiLoraRuntime]:
    base = _base()
    settings: dict[str, object] = dict(
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        max_model_len=64,
        static_decode_batches=True,
        cuda_graph_batch_sizes=(1, 2, 4, 8),
        async_scheduling=asynchronous,
    )
    settings.update(overrides)
    config = EngineConfig(**settings)  # type: ignore[arg-type]
    runtime = MultiLoraRuntime(
        base, max_tokens=config.max_num_batched_tokens, num_slots=num_slots, max_rank=max_rank
    )
    for name, directory in adapter_dirs.items():
        runtime.register(name, directory)
    return Engine(base, config, tokenizer=tokenizer, lora=runtime), runtime


def _drive(
    engine: Engine,
    arrivals: list[Arrival],
    params: SamplingParams,
) -> list[Result]:
    """Add each request before its call; run until nothing is left. One final output per
    request, nothing after it."""
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[Any]] = {}
    reasons: dict[str, str | None] = {}
    pending = sorted(arrivals, key=lambda a: a[0])
    call = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= call:
            _, prompt, name = pending.pop(0)
            rid = engine.add_request(prompt, params, lora_name=name)
            ids.append(rid)
            tokens[rid], logprobs[rid] = [], []
        for out in engine.step():
            assert out.request_id not in reasons, "output after the final one"
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [
                (lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs
            ]
            assert out.output_token_ids == tokens[out.request_id]
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        call += 1
        assert call < 500
    return [(tokens[r], logprobs[r], reasons[r]) for r in ids]


def _assert_idle(engine: Engine, runtime: MultiLoraRuntime) -> None:
    engine.step()  # idle step: finished ids reach the runner
    assert engine.runner.states == {}
    assert runtime._attached == {} and _held_slots(runtime) == 0
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert engine.overlap.in_flight is None


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_up_front_adapters_beside_base_rows_equal_sync(
    adapter_dirs: dict[str, Path], params: SamplingParams
) -> None:
    """Same steps as the synchronous engine: bit-equal tokens and logprobs; greedy tokens are
    each adapter's merged-weights tokens (so the adapters did act in the overlapped steps)."""
    prompts = _prompts(10, (5, 13, 9, 21, 3, 11, 7))
    arrivals: list[Arrival] = [(0, p, n) for p, n in zip(prompts, NAMES, strict=True)]
    reference = _drive(_engine(adapter_dirs, False)[0], arrivals, params)
    engine, runtime = _engine(adapter_dirs, True)
    got = _drive(engine, arrivals, params)
    assert got == reference
    assert engine.runner.num_overlapped_steps >= params.max_tokens // 2
    if params is GREEDY:
        assert [g[0] for g in got] == _expected(adapter_dirs, prompts, NAMES)
    _assert_idle(engine, runtime)


def test_arrivals_stop_tokens_and_slot_contention_equal_sync(
    adapter_dirs: dict[str, Path],
) -> None:
    """Requests join every other call, two adapter slots for three adapters (requests wait for
    a slot, FCFS), some stop on a token while their next step is in flight (discarded); the
    tokens are the synchronous engine's and, greedy, each merged-weights model's."""
    prompts = _prompts(11, (6, 14, 4, 9, 17, 5, 8))
    arrivals: list[Arrival] = [
        (2 * i, p, n) for i, (p, n) in enumerate(zip(prompts, NAMES, strict=True))
    ]
    free = _expected(adapter_dirs, prompts, NAMES)
    stops = tuple({free[i][3] for i in (1, 2, 4)})
    stopping = SamplingParams(
        max_tokens=10, temperature=0.0, detokenize=False, stop_token_ids=stops, logprobs=1
    )
    for params in (GREEDY, stopping, SEEDED):
        reference = _drive(_engine(adapter_dirs, False, num_slots=2)[0], arrivals, params)
        engine, runtime = _engine(adapter_dirs, True, num_slots=2)
        got = _drive(engine, arrivals, params)
        assert [g[0] for g in got] == [r[0] for r in reference]
        assert [g[2] for g in got] == [r[2] for r in reference]
        for g, r in zip(got, reference, strict=True):  # other kernels for some rows: fp32
            assert [lp[0] for lp in g[1]] == [lp[0] for lp in r[1]]
            assert [lp[1] for lp in g[1]] == pytest.approx([lp[1] for lp in r[1]], abs=1e-5)
        if params is GREEDY:
            assert [g[0] for g in got] == free
        if params is stopping:
            stopped = [i for i, g in enumerate(got) if g[2] == "stop"]
            assert len(stopped) >= 2 and any(NAMES[i] is not None for i in stopped)
        assert engine.runner.num_overlapped_steps > 0
        _assert_idle(engine, runtime)


def test_stop_strings_with_adapters_equal_sync(
    adapter_dirs: dict[str, Path], tokenizer: Any
) -> None:
    """Stop strings cut from adapter requests' own text (their next step is in flight when
    the string completes)."""
    prompts = _prompts(12, (7, 12, 5, 10))
    names: list[str | None] = ["poet", None, "coder", "support-bot"]
    arrivals: list[Arrival] = [(0, p, n) for p, n in zip(prompts, names, strict=True)]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    probe = _drive(_engine(adapter_dirs, False, tokenizer=tokenizer)[0], arrivals, plain)
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _, _ in probe]
    stops = tuple(t[len(t) // 2 : len(t) // 2 + 2] for t in (texts[0], texts[2]) if len(t) > 4)
    assert stops
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=stops)
    reference = _drive(_engine(adapter_dirs, False, tokenizer=tokenizer)[0], arrivals, params)
    engine, runtime = _engine(adapter_dirs, True, tokenizer=tokenizer)
    got = _drive(engine, arrivals, params)
    assert got == reference
    assert any(reason == "stop" for _, _, reason in got)
    assert engine.runner.num_overlapped_steps > 0
    _assert_idle(engine, runtime)


def test_abort_of_adapter_requests_with_a_step_in_flight(adapter_dirs: dict[str, Path]) -> None:
    """Adapter requests aborted between calls while the next step is in flight: their slots
    are released at once, the step in flight is read back for the others, a later request
    takes the freed slot (one slot per adapter here) and the survivors' tokens are unchanged."""
    prompts = _prompts(13, (6, 9, 5, 8, 4))
    names: list[str | None] = ["poet", None, "coder", "support-bot", "poet"]
    arrivals: list[Arrival] = [(0, p, n) for p, n in zip(prompts[:4], names[:4], strict=True)]
    arrivals.append((9, prompts[4], names[4]))  # after the abort: the freed slot again
    expected = _expected(adapter_dirs, prompts, names)
    engine, runtime = _engine(adapter_dirs, True, num_slots=3)
    aborted_at = 6
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    inflight_at_abort = False
    for call in range(40):
        for when, prompt, name in arrivals:
            if when == call:
                ids.append(engine.add_request(prompt, GREEDY, lora_name=name))
                tokens[ids[-1]] = []
        if call == aborted_at:
            inflight_at_abort = engine.overlap.in_flight is not None
            engine.abort_request(ids[0])  # poet
            engine.abort_request(ids[2])  # coder
            assert set(runtime._attached.values()) == {"support-bot"}
            assert _held_slots(runtime) == 1
        for out in engine.step():
            assert out.request_id not in (ids[0], ids[2]) or call < aborted_at
            tokens[out.request_id] += out.new_token_ids
        if not engine.has_unfinished_requests() and call > 9:
            break
    assert inflight_at_abort  # the abort did hit a step in flight
    assert 0 < len(tokens[ids[0]]) < GREEDY.max_tokens
    assert tokens[ids[0]] == expected[0][: len(tokens[ids[0]])]
    assert [tokens[ids[i]] for i in (1, 3, 4)] == [expected[i] for i in (1, 3, 4)]
    assert engine.runner.num_overlapped_steps > 0
    _assert_idle(engine, runtime)


def test_preempted_adapter_requests_reattach_under_async(
    adapter_dirs: dict[str, Path],
) -> None:
    """Too few KV blocks for four sequences: adapter requests are preempted (slot released)
    and recomputed (slot attached again) between overlapped decode steps."""
    prompts = _prompts(14, (9, 14, 6, 11))
    names: list[str | None] = [None, "support-bot", "poet", "poet"]
    arrivals: list[Arrival] = [(0, p, n) for p, n in zip(prompts, names, strict=True)]
    engine, runtime = _engine(adapter_dirs, True, num_slots=2, num_kv_blocks=14)
    got = _drive(engine, arrivals, GREEDY)
    requests = engine.scheduler.requests
    assert requests == {}
    assert [g[0] for g in got] == _expected(adapter_dirs, prompts, names)
    assert engine.runner.num_overlapped_steps > 0
    _assert_idle(engine, runtime)


def test_adapter_rejected_at_admission_under_async(adapter_dirs: dict[str, Path]) -> None:
    """An adapter that does not fit the slots (rank 8 > 4) fails only its request, also when
    it arrives while other requests' steps overlap."""
    engine, runtime = _engine(adapter_dirs, True, num_slots=8, max_rank=4)
    prompts = _prompts(15, (6, 9, 4))
    arrivals: list[Arrival] = [(0, prompts[0], "support-bot"), (0, prompts[2], None)]
    arrivals.append((4, prompts[1], "poet"))
    results = _drive(engine, arrivals, GREEDY)
    assert results[2] == ([], [], "abort")
    expected = _expected(adapter_dirs, [prompts[0], prompts[2]], ["support-bot", None])
    assert [results[0][0], results[1][0]] == expected
    assert engine.runner.num_overlapped_steps > 0
    _assert_idle(engine, runtime)


@pytest.mark.parametrize(
    ("caching", "shrunk"),
    # with prefix caching the request's two full blocks are cached free: shrink takes them first
    [(False, [95, 94]), (True, [1, 0])],
)
def test_discarded_step_is_waited_for_before_a_shrink(
    adapter_dirs: dict[str, Path], caching: bool, shrunk: list[int]
) -> None:
    """A step launched for a request that then stopped on a token is discarded, not resolved;
    `shrink_kv_blocks` must still wait for it (it writes the freed request's KV blocks)."""
    prompt = _prompts(16, (6,))[0]
    free = _expected(adapter_dirs, [prompt], ["poet"])[0]
    params = SamplingParams(
        max_tokens=10, temperature=0.0, detokenize=False, stop_token_ids=(free[4],)
    )
    engine, runtime = _engine(adapter_dirs, True, enable_prefix_caching=caching)
    out = engine.generate([prompt], params, lora_names=["poet"])[0]
    assert out.output_token_ids == free[: free.index(free[4]) + 1]
    assert engine.overlap.in_flight is None and engine.runner.num_discarded_steps == 1
    last = engine.runner.readback.last_launched
    assert last is not None and last.resolved and not last.device_done  # discarded
    assert engine.shrink_kv_blocks(2) == shrunk
    assert last.device_done
    engine.grow_kv_blocks(sorted(shrunk))
    _assert_idle(engine, runtime)
