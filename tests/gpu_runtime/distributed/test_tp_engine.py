"""The decode engine under tensor parallelism on CPU (gloo, fp32 tiny models, 2 and 4 ranks):
rank 0 schedules and samples, the followers run its runner calls, and every workload gives the
tokens of the one-GPU engine exactly (logprobs within 1e-5).

Each `start_engine_group` spawns its followers (seconds on a small machine), so one group runs
several workloads in turn; the one-GPU reference runs the same workloads in the same order
(the sampler's generator and the prefix cache carry over from one to the next alike).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.control import DriverChannel, EngineGroupError, FollowerChannel
from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.engine.engine_group import EngineGroup, ModelSource, start_engine_group
from gpu_runtime.engine.model_runner import ModelRunner
from gpu_runtime.engine.sampler import Sampler
from gpu_runtime.engine.scheduler import SchedulerOutput
from gpu_runtime.engine.tp_follower import Follower
from gpu_runtime.engine.tp_messages import Launch, Resolve
from gpu_runtime.engine.tp_runner import MirroredRunner
from gpu_runtime.engine.tp_sampling import DriverSampler
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.loader import load_tokenizer
from gpu_runtime.model.tiny import build_tiny_model_dir
from gpu_runtime.structured import StructuredOutputParams
from tests.gpu_runtime.threads import one_cpu_thread  # noqa: F401

TINY = ModelConfig.preset("tiny")  # 4 query heads, 2 KV heads: replicated at 4 ranks
MODEL = dataclasses.replace(TINY, vocab_size=509)  # a vocabulary 4 ranks do not divide
SEED = 7

Arrival = tuple[int, list[int], SamplingParams]
"""(the step before which the request is added, its prompt, its parameters)"""


def _config(**overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=96,
        static_decode_batches=True,  # the bucketed decode path async scheduling overlaps
        cuda_graph_batch_sizes=(1, 2, 4),
    )
    return EngineConfig(**{**base, **overrides})


def _prompts(seed: int, lengths: tuple[int, ...], prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, 500, (prefix,), generator=gen).tolist()
    return [shared + torch.randint(1, 500, (n,), generator=gen).tolist() for n in lengths]


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, **kw
    )


def _drive(engine: Engine, arrivals: list[Arrival]) -> tuple[dict[tuple[int, int], Any], int]:
    """Add each request before its step and run to the end. Per (request, child): tokens,
    logprobs, top logprobs, finish reason, cached prompt tokens; and the most preemptions any
    request had."""
    pending = sorted(arrivals, key=lambda a: a[0])
    order: dict[str, int] = {}
    results: dict[tuple[int, int], Any] = {}
    preemptions = step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            order[engine.add_request(prompt, params)] = len(order)
        for out in engine.step():
            key = (order[out.parent_id or out.request_id], out.index)
            tokens, logprobs, tops, _, _ = results.get(key, ([], [], [], None, 0))
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs]
            tops += [lp.top for lp in out.new_logprobs]
            results[key] = (tokens, logprobs, tops, out.finish_reason, out.num_cached_tokens)
        live = engine.scheduler.requests.values()
        preemptions = max([preemptions, *(r.num_preemptions for r in live)])
        step += 1
    return results, preemptions


def _workloads(small_kv: bool) -> list[list[Arrival]]:
    """Greedy with logprobs (all queued at once); staggered arrivals sharing a cached prefix;
    seeded and unseeded random sampling with a penalty; a fan-out of 2."""
    long = 20 if small_kv else 10
    queued = [(0, p, _greedy(long, logprobs=2)) for p in _prompts(1, (5, 9, 3, 12))]
    staggered = [
        (2 * i, p, _greedy(long - 2, logprobs=0))
        for i, p in enumerate(_prompts(2, (3, 6, 1, 9), prefix=8))
    ]
    sampled = [
        (
            0,
            p,
            SamplingParams(
                max_tokens=8,
                temperature=0.9,
                seed=s,
                ignore_eos=True,
                detokenize=False,
                presence_penalty=0.5 if s is None else 0.0,
            ),
        )
        for p, s in zip(_prompts(3, (4, 7, 5)), (11, None, 12), strict=True)
    ]
    fanned = [
        (
            0,
            _prompts(4, (6,))[0],
            SamplingParams(
                max_tokens=6, temperature=0.8, seed=5, n=2, ignore_eos=True, detokenize=False
            ),
        )
    ]
    return [queued, staggered, sampled, fanned]


def _run_all(engine: Engine, workloads: list[list[Arrival]]) -> list[tuple[dict, int]]:
    return [_drive(engine, arrivals) for arrivals in workloads]


def _assert_same(got: list[tuple[dict, int]], want: list[tuple[dict, int]]) -> None:
    assert len(got) == len(want)
    for (ours, _), (theirs, _) in zip(got, want, strict=True):
        assert ours.keys() == theirs.keys()
        for key, (tokens, logprobs, tops, reason, cached) in theirs.items():
            o_tokens, o_logprobs, o_tops, o_reason, o_cached = ours[key]
            assert (o_tokens, o_reason, o_cached) == (tokens, reason, cached), key
            torch.testing.assert_close(
                torch.tensor(o_logprobs), torch.tensor(logprobs), rtol=0, atol=1e-5
            )
            assert [[t for t, _ in top] for top in o_tops] == [[t for t, _ in top] for top in tops]


def _reference(config: EngineConfig, workloads: list[list[Arrival]]) -> list[tuple[dict, int]]:
    return _run_all(Engine(build_random_model(MODEL, seed=SEED), config), workloads)


def _group(config: EngineConfig, size: int, **kw: Any) -> EngineGroup:
    return start_engine_group(
        ModelSource(config=MODEL, seed=SEED), config, size, cpu_threads=1, timeout_s=120, **kw
    )


def test_size_one_keeps_the_plain_runner_and_sampler() -> None:
    engine = Engine(build_random_model(MODEL, seed=SEED), _config())
    assert type(engine.runner) is ModelRunner and type(engine.runner.sampler) is Sampler
    with pytest.raises(ValueError, match="only then: size 1"):
        Engine(engine.runner.model, _config(), control=DriverChannel.__new__(DriverChannel))
    with pytest.raises(ValueError, match="2 or more ranks, got size 1"):
        start_engine_group(ModelSource(config=MODEL), _config(), 1)


def test_two_ranks_async_with_prefix_caching_give_the_one_gpu_tokens() -> None:
    """Async scheduling (steps launched ahead gather their inputs from the broadcast tokens),
    prefix hits, seeded and penalised sampling, a fan-out; an idle group keeps beating."""
    config = _config(async_scheduling=True, enable_prefix_caching=True)
    workloads = _workloads(small_kv=False)
    want = _reference(config, [*workloads, workloads[0]])
    with _group(config, 2, heartbeat_s=0.2) as group:
        engine = group.engine
        assert isinstance(engine.runner, MirroredRunner)
        assert isinstance(engine.runner.sampler, DriverSampler)
        got = _run_all(engine, workloads)
        assert engine.runner.num_overlapped_steps > 0
        assert max(cached for _, _, _, _, cached in got[1][0].values()) > 0  # prefix hits
        channel = group.channel
        beats = channel.num_heartbeats
        while channel.num_heartbeats < beats + 2:  # idle: the keep-alive thread sends
            assert not channel.failed.wait(0.05), channel.failure
        got.append(_drive(engine, workloads[0]))  # the followers skipped the heartbeats
    _assert_same(got, want)


def test_two_ranks_sync_with_preemption_then_a_dead_follower() -> None:
    """Synchronous steps, a KV budget that forces preemption; then a follower is killed and
    the next step fails at once with an error naming it (no hang), and shutdown completes."""
    config = _config(num_kv_blocks=14, enable_prefix_caching=False)
    workloads = _workloads(small_kv=True)[:2]
    want = _reference(config, workloads)
    assert max(p for _, p in want) >= 1
    group = _group(config, 2)
    try:
        got = _run_all(group.engine, workloads)
        _assert_same(got, want)
        group.processes[0].kill()
        assert group.failed.wait(60), "the monitor did not see the follower die"
        assert "follower rank 1 exited" in (group.failure or "")
        group.engine.add_request([1, 2, 3], _greedy(3))
        with pytest.raises(EngineGroupError, match="follower rank 1 exited"):
            group.engine.step()
    finally:
        group.shutdown()
    assert not any(p.is_alive() for p in group.processes)


def test_four_ranks_replicated_kv_heads_async_with_preemption() -> None:
    """4 ranks over 2 KV heads (each held by two ranks), async, a KV budget that preempts."""
    config = _config(num_kv_blocks=14, async_scheduling=True)
    workloads = [_workloads(small_kv=True)[0], _workloads(small_kv=True)[2]]
    want = _reference(config, workloads)
    assert want[0][1] >= 1
    with _group(config, 4) as group:
        got = _run_all(group.engine, workloads)
    _assert_same(got, want)
    assert [p.exitcode for p in group.processes] == [0, 0, 0]


def _refusing_storage(*args: Any) -> Any:
    raise ValueError("no KV storage on this rank")


def test_a_rank_that_cannot_start_fails_the_start_on_every_rank() -> None:
    with pytest.raises(
        EngineGroupError, match="(?s)1 rank.s. failed to start:\nrank 0: .*no KV storage"
    ):
        _group(_config(), 2, kv_storage_factory=_refusing_storage)


def test_two_ranks_from_a_directory_with_a_grammar_async(tmp_path: Path) -> None:
    """Each rank loads its slices of a checkpoint; text prompts through rank 0's tokenizer; a
    JSON-schema row beside free rows under async scheduling: the step ahead's sampling is
    deferred until rank 0's matchers hold the previous tokens (mirrored as its own message),
    and rank 0 alone masks and samples."""
    directory = build_tiny_model_dir(tmp_path / "tiny", "llama", seed=5)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    constrained = SamplingParams(
        max_tokens=30,
        temperature=0.0,
        structured_output=StructuredOutputParams.json_schema(schema),
    )
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [("A decode engine reads", constrained), ("Hello, world!", free), ("x y", free)]
    config = _config(async_scheduling=True, max_num_batched_tokens=32, max_model_len=128)

    def run(engine: Engine) -> list[tuple[list[int], str, str | None]]:
        ids = [engine.add_request(p, params) for p, params in prompts]
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = (out.output_token_ids, out.text, out.finish_reason)
        return [final[i] for i in ids]

    want = run(Engine.from_directory(directory, config))
    source = ModelSource(directory=str(directory))
    with start_engine_group(
        source, config, 2, tokenizer=load_tokenizer(directory), cpu_threads=1, timeout_s=120
    ) as group:
        got = run(group.engine)
        assert group.engine.runner.num_deferred_samplings > 0
    assert got == want
    assert json.loads(got[0][1])["n"] is not None


def test_a_follower_refuses_a_message_that_shows_divergence() -> None:
    """A follower checks rank 0's step numbers: a launch numbered otherwise, or a step it does
    not hold, raises (no collective runs: the plans are empty)."""
    fake = object()  # never used: nothing below communicates
    rank1 = TensorParallel(rank=1, size=2, group=fake, finetune_group=fake, control_group=fake)
    model = CausalLM(MODEL, parallel=rank1)
    follower = Follower(model, _config(), FollowerChannel(rank1))
    empty = SchedulerOutput([], [], {})
    follower.apply(Launch(0, empty))  # step 0, resolved at launch: nothing held
    with pytest.raises(EngineGroupError, match="launched step 1 for rank 0's step 5"):
        follower.apply(Launch(5, empty))
    with pytest.raises(EngineGroupError, match="holds no unresolved step 0"):
        follower.apply(Resolve(0))
    with pytest.raises(ValueError, match="only rank 0 runs an Engine"):
        Engine(model, _config(), control=DriverChannel.__new__(DriverChannel))
