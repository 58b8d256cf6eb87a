from __future__ import annotations

import pytest

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.request import Request, RequestStatus, SamplingParams
from gpu_runtime.engine.scheduler import SchedulerOutput


def _scheduler(blocks: int, budget: int = 16, seqs: int = 4) -> ContinuousBatchingScheduler:
    config = EngineConfig(
        num_kv_blocks=blocks,
        block_size=4,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=64,
        enable_prefix_caching=False,  # block ids without the cache (on: test_prefix_caching)
    )
    return ContinuousBatchingScheduler(config, BlockManager(blocks, 4))


def _request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def _run(s: ContinuousBatchingScheduler, plan: SchedulerOutput, token: int = 7) -> None:
    sampled = {
        rid: token
        for rid, n in plan.num_scheduled_tokens.items()
        if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens
    }
    s.update_from_output(plan, sampled)


def test_chunked_prefill_then_decode_with_diffs() -> None:
    s = _scheduler(blocks=16, budget=8)
    s.add_request(_request("a", 10))
    s.add_request(_request("b", 3))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 8}
    assert [n.request_id for n in plan.new_requests] == ["a"]
    assert plan.new_requests[0].block_ids == [0, 1]
    _run(s, plan)
    plan = s.schedule()
    # a finishes its prompt (2 tokens, one more block), b is admitted with the rest of the budget
    assert plan.num_scheduled_tokens == {"a": 2, "b": 3}
    assert plan.cached_requests[0].new_block_ids == [2]
    assert plan.new_requests[0].request_id == "b" and plan.new_requests[0].block_ids == [3]
    _run(s, plan)
    assert s.requests["a"].output_token_ids == [7] and s.requests["b"].output_token_ids == [7]
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not plan.new_requests
    assert plan.cached_requests == []  # no new blocks: only in num_scheduled_tokens


def test_admission_waits_for_free_blocks_and_sequence_limit() -> None:
    s = _scheduler(blocks=4, budget=32, seqs=2)
    s.add_request(_request("a", 8, max_tokens=4))
    s.add_request(_request("b", 8, max_tokens=4))
    s.add_request(_request("c", 1, max_tokens=1))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 8, "b": 8}  # c: sequence limit
    _run(s, plan)
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    plan = s.schedule()
    assert plan.finished_request_ids == {"a"}
    assert plan.num_scheduled_tokens == {"b": 1, "c": 1}
    # a's blocks [0, 1] are free again: lowest first, b grows into 0 and c gets 1
    assert s.requests["b"].block_table == [2, 3, 0] and s.requests["c"].block_table == [1]


def test_preemption_recomputes_latest_request() -> None:
    s = _scheduler(blocks=4, budget=16, seqs=4)
    s.add_request(_request("a", 4, max_tokens=8))
    s.add_request(_request("b", 4, max_tokens=8))
    s.add_request(_request("c", 4, max_tokens=8))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 4, "b": 4, "c": 4}
    _run(s, plan)
    # each needs a 2nd block for its 5th token and one block is free: a takes it, b preempts
    # the latest request (c) and takes its block
    plan = s.schedule()
    assert plan.preempted_request_ids == ["c"] and plan.finished_request_ids == {"c"}
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert s.requests["c"].num_computed_tokens == 0 and s.requests["c"].num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.requests["b"].block_table == [1, 2]
    _run(s, plan)
    s.finish_request("a", RequestStatus.FINISHED_LENGTH)
    plan = s.schedule()
    assert plan.finished_request_ids == {"a"}
    # c comes back as new data with prompt + generated token, recomputed from scratch
    assert plan.new_requests[0].request_id == "c"
    assert plan.new_requests[0].token_ids == [1, 2, 3, 4, 7]
    assert plan.num_scheduled_tokens == {"b": 1, "c": 5}
    # a running request that cannot grow with nothing else to preempt preempts itself
    s2 = _scheduler(blocks=2, budget=16)
    s2.add_request(_request("x", 4, max_tokens=2))
    _run(s2, s2.schedule())
    assert s2.block_manager.shrink(1) == [1]
    plan = s2.schedule()
    assert plan.preempted_request_ids == ["x"] and plan.is_empty


def test_abort_frees_blocks_everywhere() -> None:
    s = _scheduler(blocks=8)
    s.add_request(_request("a", 6))
    s.add_request(_request("b", 30, max_tokens=2))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 6, "b": 10}
    s.abort_request("b")
    s.abort_request("missing")
    assert s.block_manager.num_free_blocks == 6
    assert not any(r.request_id == "b" for r in s.running)
    assert s.schedule().finished_request_ids == {"b"}


class _Slots:
    """A pool of adapter slots in plain Python: one name per slot, shared by its requests."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.holders: dict[str, str] = {}  # request id -> adapter name
        self.calls: list[tuple[str, str]] = []

    def admit(self, request_id: str, name: str) -> bool:
        names = set(self.holders.values())
        if name not in names and len(names) == self.num_slots:
            self.calls.append(("refused", request_id))
            return False
        assert request_id not in self.holders
        self.holders[request_id] = name
        self.calls.append(("admit", request_id))
        return True

    def release(self, request_id: str) -> None:
        del self.holders[request_id]
        self.calls.append(("release", request_id))


def test_adapter_admission_is_fcfs_and_every_exit_releases_the_slot() -> None:
    slots = _Slots(1)
    config = EngineConfig(
        num_kv_blocks=4,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        enable_prefix_caching=False,  # block ids without the cache (on: test_prefix_caching)
    )
    s = ContinuousBatchingScheduler(
        config, BlockManager(4, 4), admit_adapter=slots.admit, release_adapter=slots.release
    )
    for rid, name in (("a", "x"), ("b", "x"), ("c", "y"), ("d", None)):
        r = _request(rid, 4, max_tokens=8)
        r.lora_name = name
        s.add_request(r)
    plan = s.schedule()
    # a and b share adapter x's slot; c needs a second slot and waits; d (base) waits behind c
    assert plan.num_scheduled_tokens == {"a": 4, "b": 4}
    assert slots.calls == [("admit", "a"), ("admit", "b"), ("refused", "c")]
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    _run(s, plan)
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    s.abort_request("b")
    assert slots.calls[-2:] == [("release", "a"), ("release", "b")]
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"c": 4, "d": 4}
    assert slots.holders == {"c": "y"}
    _run(s, plan)
    # both need a 2nd block; with the 2 free blocks taken away, c's growth preempts the latest
    # request (d, base model: nothing to release)
    assert s.requests["c"].block_table == [0] and s.requests["d"].block_table == [1]
    assert s.block_manager.shrink(2) == [3, 2]
    plan = s.schedule()
    assert plan.preempted_request_ids == ["d"] and slots.calls[-1] == ("admit", "c")
    while not plan.preempted_request_ids or plan.preempted_request_ids == ["d"]:
        _run(s, plan)
        plan = s.schedule()
    # c outgrew the 2 blocks left and preempted itself: its slot is released
    assert plan.preempted_request_ids == ["c"] and plan.is_empty
    assert slots.calls[-1] == ("release", "c") and slots.holders == {}
    s.block_manager.grow([2, 3])
    plan = s.schedule()  # c comes back first (recomputed) and attaches again
    assert slots.calls[-1] == ("admit", "c") and list(plan.num_scheduled_tokens) == ["c"]
    assert [r.request_id for r in s.waiting] == ["d"]


def test_requests_are_validated_against_storage_capacity_not_usable_blocks() -> None:
    config = EngineConfig(
        num_kv_blocks=2,
        kv_block_capacity=8,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    s = ContinuousBatchingScheduler(config, BlockManager(2, 4, capacity=8))
    s.add_request(_request("fits-storage", 17, max_tokens=8))  # 7 blocks: more than usable
    with pytest.raises(ValueError, match="needs 9 KV blocks, the KV storage holds 8"):
        s.add_request(_request("too-long", 30, max_tokens=4))
    assert s.schedule().is_empty  # waits for the pool to map more blocks
    s.block_manager.grow([2, 3, 4, 5, 6, 7])
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"fits-storage": 17}
    assert plan.new_requests[0].block_ids == [0, 1, 2, 3, 4]


def test_decode_follows_only_a_steady_decode_step() -> None:
    """Asked right after `schedule()` (as the engine asks before reading the step back): the
    next step is sure to decode the same requests only when every running request is sampled
    by this one, none stops on length with the token, nothing waits and free blocks cover
    every row's next token."""
    s = _scheduler(blocks=8, budget=16, seqs=4)
    s.add_request(_request("a", 3, max_tokens=3))
    s.add_request(_request("b", 10, max_tokens=8))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 3, "b": 10}  # both prompts whole: both sampled
    assert s.decode_follows(plan, max_rows=2)
    assert not s.decode_follows(plan, max_rows=1)  # more rows than the largest bucket
    s.add_request(_request("c", 2))
    assert not s.decode_follows(plan, max_rows=2)  # c waits: the next step admits it
    s.abort_request("c")
    _run(s, plan)
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1} and s.decode_follows(plan, 2)
    _run(s, plan)
    plan = s.schedule()
    assert not s.decode_follows(plan, max_rows=2)  # a's third token is its last
    _run(s, plan)
    s.finish_request("a", RequestStatus.FINISHED_LENGTH)
    b = s.requests["b"]
    while True:
        plan = s.schedule()
        if b.num_tokens == len(b.block_table) * 4:  # the next token needs a new block
            break
        _run(s, plan)
    assert s.decode_follows(plan, max_rows=2)
    s.block_manager.shrink(s.block_manager.num_free_blocks)
    assert not s.decode_follows(plan, max_rows=2)  # no block for it
