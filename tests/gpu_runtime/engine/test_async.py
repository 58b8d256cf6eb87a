"""Async scheduling (`EngineConfig.async_scheduling`) on CPU: the next decode step is launched
before the current one's tokens are read back, over the bucketed decode path; the tokens must
be those of the synchronous engine and of HF."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config
from tests.gpu_runtime.engine.test_engine import GREEDY, _hf_greedy, _prompts


def _config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_kv_blocks=96,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        max_model_len=128,
        static_decode_batches=True,
        cuda_graph_batch_sizes=(1, 2, 4),
        async_scheduling=True,
    )
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _sync(**overrides: object) -> EngineConfig:
    return _config(async_scheduling=False, **overrides)


def _run_staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """A new request every other step; finished outputs in arrival order."""
    finished: dict[str, object] = {}
    ids: list[str] = []
    pending = list(prompts)
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            ids.append(engine.add_request(pending.pop(0), params))
        for out in engine.step():
            assert out.request_id not in finished  # one final output per request
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    return [finished[i] for i in ids]


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_async_greedy_equals_hf_generate(architecture: str) -> None:
    model = build_random_model(tiny_config(architecture), seed=21)
    prompts = _prompts(0, (3, 17, 40, 9, 26))
    expected = _hf_greedy(model, prompts, GREEDY.max_tokens)
    engine = Engine(model, _config())
    outputs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.runner.num_overlapped_steps >= GREEDY.max_tokens // 2
    assert engine.runner.states == {} or not engine.has_unfinished_requests()


def test_async_staggered_arrivals_and_stop_tokens_equal_sync(tiny_llama: CausalLM) -> None:
    """Arrivals force synchronous steps; stop tokens end requests whose next step was already
    launched (discarded); sampled requests with seeds and logprobs."""
    prompts = _prompts(1, (5, 30, 12, 2, 44, 8))
    probe = Engine(tiny_llama, _sync()).generate(prompts, GREEDY)
    # stop on tokens that some requests produce midway
    stops = tuple({o.output_token_ids[4] for o in probe[:3]})
    cases = [
        SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, stop_token_ids=stops),
        SamplingParams(
            max_tokens=12,
            temperature=0.8,
            top_k=20,
            seed=7,
            detokenize=False,
            ignore_eos=True,
            logprobs=2,
        ),
        SamplingParams(max_tokens=9, temperature=1.0, seed=3, detokenize=False, ignore_eos=True),
    ]
    for params in cases:
        expected = _run_staggered(Engine(tiny_llama, _sync()), prompts, params)
        engine = Engine(tiny_llama, _config())
        got = _run_staggered(engine, prompts, params)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
        if params.logprobs:
            for a, b in zip(got, expected, strict=True):
                assert a.new_logprobs[0].token_id == b.new_logprobs[0].token_id
                assert a.new_logprobs[0].logprob == pytest.approx(
                    b.new_logprobs[0].logprob, abs=1e-5
                )
        assert engine.runner.num_overlapped_steps > 0
        assert not engine.has_unfinished_requests()
        engine.step()  # idle step: finished ids reach the runner
        assert engine.runner.states == {}
        assert engine.block_manager.num_free_blocks == 96


def test_async_preemption_gives_the_same_tokens(tiny_llama: CausalLM) -> None:
    prompts = _prompts(2, (9, 14, 6, 11))
    expected = [
        Engine(tiny_llama, _sync(max_num_seqs=1)).generate([p], GREEDY)[0].output_token_ids
        for p in prompts
    ]
    engine = Engine(tiny_llama, _config(num_kv_blocks=14))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.block_manager.num_free_blocks == 14
    assert engine.runner.num_overlapped_steps > 0


@pytest.mark.parametrize(
    ("caching", "shrunk"),
    # with prefix caching the aborted request's full block 8 is cached free: shrink takes it
    # first, then the highest empty id
    [(False, [95, 94]), (True, [8, 95])],
)
def test_async_abort_and_shrink_between_steps(
    tiny_llama: CausalLM, caching: bool, shrunk: list[int]
) -> None:
    prompts = _prompts(3, (7, 13, 5))
    expected = Engine(tiny_llama, _sync()).generate(prompts, GREEDY)
    engine = Engine(tiny_llama, _config(enable_prefix_caching=caching))
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    victim = engine.add_request([1, 2, 3, 4], GREEDY)
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 4:
            engine.abort_request(victim)
            assert engine.shrink_kv_blocks(2) == shrunk
        for out in engine.step():
            assert out.request_id != victim or steps < 4
            if out.finished:
                finished[out.request_id] = out.output_token_ids
        steps += 1
    assert [finished[i] for i in ids] == [o.output_token_ids for o in expected]
    engine.step()
    assert engine.runner.states == {}


def test_launch_before_resolve_rejects_general_steps(tiny_llama: CausalLM) -> None:
    """A step launched while the previous one is unresolved must be bucketed decode-only."""
    engine = Engine(tiny_llama, _sync(static_decode_batches=False))
    engine.add_request([5, 6, 7], GREEDY)
    runner = engine.runner
    plan = engine.scheduler.schedule()
    handle = runner.launch(plan)  # the prompt: sampled, not read back
    engine.scheduler.update_from_output(plan, {rid: -1 for rid in handle.sampled_ids})
    with pytest.raises(RuntimeError, match="bucketed decode-only"):
        runner.launch(engine.scheduler.schedule())
    assert torch.is_tensor(handle.token_ids)


def test_async_step_after_a_stop_token_is_discarded(tiny_llama: CausalLM) -> None:
    """One request stops on a token while its next step is already launched: that step is
    dropped (no output, no unfinished request), and the engine goes on with new requests."""
    prompt = _prompts(5, (6,))[0]
    free = Engine(tiny_llama, _sync()).generate([prompt], GREEDY)[0].output_token_ids
    params = SamplingParams(
        max_tokens=10, temperature=0.0, detokenize=False, stop_token_ids=(free[5],)
    )
    engine = Engine(tiny_llama, _config())
    out = engine.generate([prompt], params)[0]
    assert out.output_token_ids == free[: free.index(free[5]) + 1]
    assert out.finish_reason == "stop" and engine.overlap.in_flight is None
    assert engine.generate([prompt], GREEDY)[0].output_token_ids == free
    engine.step()
    assert engine.runner.states == {}


def test_async_arrival_during_a_step_in_flight_waits_one_call(tiny_llama: CausalLM) -> None:
    """A request added while a decode step is in flight gets its first token one call later
    than on the synchronous engine (the step in flight cannot take it): one step of TTFT; the
    call that returns the step in flight launches nothing after it (the request waits)."""
    first_call: dict[bool, int] = {}
    for asynchronous in (False, True):
        engine = Engine(tiny_llama, _config(async_scheduling=asynchronous))
        engine.add_request([1, 2, 3, 4, 5], GREEDY)
        late = ""
        for call in range(8):
            if call == 3:
                late = engine.add_request([7, 8, 9], GREEDY)
            if any(out.request_id == late for out in engine.step()):
                first_call.setdefault(asynchronous, call)
        if asynchronous:
            assert engine.runner.num_overlapped_steps > 0
    assert first_call == {False: 3, True: 4}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_on_launched_runs_while_the_step_is_queued(
    tiny_llama: CausalLM, asynchronous: bool
) -> None:
    """`Engine.step(on_launched=...)`, the co-location loop's hook for launching a finetune
    quantum beside the step: called once per step that runs, after its launch and before it is
    read back, never for a call that runs nothing; the tokens are those of steps without it.
    A hook that raises fails the call only after the step was applied: the engine goes on."""
    prompts = _prompts(5, (3, 17, 9))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = [
        o.output_token_ids
        for o in Engine(tiny_llama, _config(async_scheduling=asynchronous)).generate(
            prompts, params
        )
    ]
    engine = Engine(tiny_llama, _config(async_scheduling=asynchronous))
    runner = engine.runner
    seen: list[tuple[int, bool]] = []

    def hook() -> None:
        last = runner.readback.last_launched
        seen.append((runner._num_launched, last is not None and not last.resolved))

    assert engine.step(on_launched=hook) == [] and seen == []  # nothing to run: no call
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    calls = 0
    while engine.has_unfinished_requests():
        before = len(seen)
        for out in engine.step(on_launched=hook):
            tokens[out.request_id] = out.output_token_ids
        calls += 1
        assert len(seen) == before + 1  # once per call that ran a step
        assert seen[-1][1]  # the step it follows is launched, not yet read back
    assert [tokens[i] for i in ids] == expected
    assert len(seen) == calls

    def broken() -> None:
        raise RuntimeError("executor is closed")

    rid = engine.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="executor is closed"):
        engine.step(on_launched=broken)
    while engine.has_unfinished_requests():  # the step it raised in was applied
        for out in engine.step():
            tokens[out.request_id] = out.output_token_ids
    assert tokens[rid] == expected[0]
