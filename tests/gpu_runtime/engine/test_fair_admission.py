"""Admission is fair across tenants: preempted requests first, then one new request of each
tenant in turn, FIFO within a tenant; one tenant's large batch delays another tenant's first
token by a bounded number of steps, not by the batch."""

from __future__ import annotations

import random

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.request import Request, RequestStatus
from gpu_runtime.engine.scheduler import SchedulerOutput
from gpu_runtime.engine.waiting_queue import WaitingQueue
from gpu_runtime.model import CausalLM


def _request(rid: str, tenant: str, prompt_len: int = 4, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(range(1, prompt_len + 1)), params, tenant=tenant)


def _ids(requests: object) -> list[str]:
    return [r.request_id for r in requests]  # type: ignore[attr-defined]


def test_the_order_is_preempted_first_then_tenants_in_turn() -> None:
    queue = WaitingQueue()
    for rid, tenant in (("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C")):
        queue.add(_request(rid, tenant))
    queue.add(_request("b2", "B"))
    assert _ids(queue) == ["a1", "b1", "c1", "a2", "b2", "a3"]
    old = _request("p1", "A")
    queue.add_preempted(old)
    queue.add_preempted(_request("p2", "C"))  # the latest preempted goes first
    assert _ids(queue)[:3] == ["p2", "p1", "a1"] and len(queue) == 8 and old in queue
    assert _ids([queue.pop_first(), queue.pop_first()]) == ["p2", "p1"]
    assert queue.pop_first().request_id == "a1"  # A's turn passes: B, C, then A again
    assert _ids(queue) == ["b1", "c1", "a2", "b2", "a3"]
    queue.add(_request("d1", "D"))  # a new tenant joins the end of the rotation
    assert _ids(queue) == ["b1", "c1", "a2", "d1", "b2", "a3"]
    queue.remove(next(r for r in queue if r.request_id == "c1"))  # C leaves the rotation
    assert _ids(queue) == ["b1", "a2", "d1", "b2", "a3"]
    assert not any(r.request_id == "c1" for r in queue) and len(queue) == 5


def test_taking_the_first_request_leaves_the_rest_of_the_order() -> None:
    """What lets a step admit a prefix of the order and the next step go on from there."""
    rng = random.Random(7)
    queue = WaitingQueue()
    for step in range(2000):
        action = rng.random()
        if action < 0.5 or not queue:
            queue.add(_request(f"r{step}", rng.choice("ABCD")))
        elif action < 0.6:
            queue.add_preempted(_request(f"p{step}", rng.choice("ABCD")))
        elif action < 0.7:
            queue.remove(rng.choice(list(queue)))
        else:
            before = list(queue)
            assert queue.pop_first() is before[0]
            assert list(queue) == before[1:]
        assert len(queue) == len(list(queue))


def _run(s: ContinuousBatchingScheduler, plan: SchedulerOutput) -> None:
    sampled = {
        rid: 7
        for rid, n in plan.num_scheduled_tokens.items()
        if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens
    }
    s.update_from_output(plan, sampled)


def test_the_scheduler_admits_tenants_in_turn_and_preempted_requests_first() -> None:
    config = EngineConfig(
        num_kv_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64
    )
    s = ContinuousBatchingScheduler(config, BlockManager(4, 4))
    for i in range(5):
        s.add_request(_request(f"a{i}", "A"))
    s.add_request(_request("b0", "B"))
    s.add_request(_request("b1", "B"))
    plan = s.schedule()
    assert list(plan.num_scheduled_tokens) == ["a0", "b0"]  # not a0, a1 (FIFO)
    assert _ids(s.waiting) == ["a1", "b1", "a2", "a3", "a4"]
    _run(s, plan)
    s.finish_request("b0", RequestStatus.FINISHED_STOPPED)
    plan = s.schedule()
    assert list(plan.num_scheduled_tokens) == ["a0", "a1"]
    _run(s, plan)
    assert s.requests["a0"].block_table == [0, 1] and s.requests["a1"].block_table == [2]
    # a1 needs a 2nd block for its 5th token; with the last free one taken away it preempts
    # itself, and goes back ahead of every tenant's new requests
    assert s.block_manager.shrink(1) == [3]
    plan = s.schedule()
    assert plan.preempted_request_ids == ["a1"]
    assert _ids(s.waiting) == ["a1", "b1", "a2", "a3", "a4"]


def test_one_tenant_alone_is_first_come_first_served() -> None:
    config = EngineConfig(
        num_kv_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64
    )
    s = ContinuousBatchingScheduler(config, BlockManager(16, 4))
    for i in range(4):
        s.add_request(_request(f"r{i}", ""))
    assert list(s.schedule().num_scheduled_tokens) == ["r0", "r1"]
    assert _ids(s.waiting) == ["r2", "r3"]


SEQS = 4
A_PROMPTS = 200
A_MAX_TOKENS = 8
BOUND_STEPS = A_MAX_TOKENS
"""The bound of the engine's README for this setup: each of A's running requests has at most
L = A_MAX_TOKENS - 1 steps left when B arrives, one step after they end B (second in the
order) is admitted and its one-chunk prompt sampled: K = L + 1 steps."""


def _steps_to_first_token(
    model: CausalLM, arrival_step: int, b_tenant: str
) -> tuple[int, int, list[int]]:
    """(steps from B's arrival to its first token, A's requests finished by then, B's tokens)
    with A's batch queued first and B's one prompt added after `arrival_step` steps."""
    config = EngineConfig(
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=SEQS,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    engine = Engine(model, config)
    a_params = SamplingParams(max_tokens=A_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(A_PROMPTS):
        engine.add_request([3 + i % 50, 9, 4, 11, 2], a_params, f"a{i}", tenant="A")
    for _ in range(arrival_step):
        engine.step()
    b_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 8, 13, 21], b_params, "b", tenant=b_tenant)
    a_finished = sum(1 for i in range(A_PROMPTS) if engine.scheduler.get_request(f"a{i}") is None)
    steps = 0
    while True:
        steps += 1
        outputs = {out.request_id: out for out in engine.step()}
        a_finished += sum(1 for rid, out in outputs.items() if rid != "b" and out.finished)
        b = outputs.get("b")
        if b is not None and b.new_token_ids:
            break
    while not b.finished:
        b = next(out for out in engine.step() if out.request_id == "b")
    return steps, a_finished, list(b.output_token_ids)


def test_another_tenants_first_token_waits_a_bounded_number_of_steps(tiny_llama: CausalLM) -> None:
    alone = Engine(
        tiny_llama,
        EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=SEQS, max_model_len=64),
    )
    b_alone = alone.generate(
        [[5, 8, 13, 21]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )[0]
    waits = []
    for arrival in range(A_MAX_TOKENS + 1):  # every phase of A's running batch
        steps, a_finished, b_tokens = _steps_to_first_token(tiny_llama, arrival, "B")
        assert a_finished <= SEQS  # at most A's first batch: long before A's is through
        assert b_tokens == b_alone.output_token_ids  # the tokens B gets alone
        waits.append(steps)
    assert max(waits) == BOUND_STEPS, waits  # the bound, reached
    # The same prompt of A's own tenant waits behind all of A's batch (FIFO within a tenant).
    steps, a_finished, _ = _steps_to_first_token(tiny_llama, 0, "A")
    assert a_finished >= A_PROMPTS - SEQS + 1
    assert steps >= (A_PROMPTS // SEQS) * A_MAX_TOKENS
