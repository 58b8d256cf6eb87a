"""`preview()` is the next `schedule()` as figures and changes nothing; the scheduler's views
are read-only."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.request import Request, RequestStatus, SamplingParams
from gpu_runtime.engine.scheduler import (
    AdapterAdmissionError,
    SchedulerOutput,
    StepPreview,
)


def _config(blocks: int, budget: int, seqs: int) -> EngineConfig:
    return EngineConfig(
        num_kv_blocks=blocks,
        block_size=4,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=64,
        enable_prefix_caching=False,  # block ids without the cache (on: test_prefix_caching)
    )


def _scheduler(
    blocks: int,
    budget: int = 16,
    seqs: int = 4,
    admit: Callable[[str, str], bool] | None = None,
    admissible: Callable[[str, str], bool] | None = None,
) -> ContinuousBatchingScheduler:
    return ContinuousBatchingScheduler(
        _config(blocks, budget, seqs),
        BlockManager(blocks, 4),
        admit_adapter=admit,
        release_adapter=(lambda rid: None) if admit is not None else None,
        adapter_admissible=admissible,
    )


def _request(rid: str, prompt_len: int, max_tokens: int = 8, lora: str | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(range(1, prompt_len + 1)), params, lora_name=lora)


def _state(s: ContinuousBatchingScheduler) -> tuple[object, ...]:
    return (
        [(r.request_id, r.status, r.num_computed_tokens, list(r.block_table)) for r in s.running],
        [(r.request_id, r.status, r.num_computed_tokens, list(r.block_table)) for r in s.waiting],
        s.block_manager.free_block_ids(),
        sorted(s.requests),
    )


def _schedule_after_preview(
    s: ContinuousBatchingScheduler, monkeypatch: pytest.MonkeyPatch
) -> tuple[StepPreview, SchedulerOutput]:
    """Preview (twice: nothing may change), then schedule, counting the blocks it allocates;
    asserts the preview's plan is the schedule's."""
    before = _state(s)
    preview = s.preview()
    assert s.preview() == preview
    assert _state(s) == before
    running = {r.request_id: r for r in s.running}
    allocated: list[int] = []
    allocate = s.block_manager.allocate

    def counting(num_blocks: int) -> list[int]:
        allocated.append(num_blocks)
        return allocate(num_blocks)

    monkeypatch.setattr(s.block_manager, "allocate", counting)
    plan = s.schedule()
    monkeypatch.undo()
    assert list(preview.num_scheduled_tokens.items()) == list(plan.num_scheduled_tokens.items())
    assert list(preview.preempted_request_ids) == plan.preempted_request_ids
    assert preview.new_blocks == sum(allocated)
    assert preview.tokens_used == plan.total_num_scheduled_tokens
    assert preview.is_empty == plan.is_empty
    decode = [
        rid
        for rid, count in plan.num_scheduled_tokens.items()
        if rid in running and running[rid].num_computed_tokens == running[rid].num_tokens - 1
    ]
    assert list(preview.decode_request_ids) == decode
    assert list(preview.decode_contexts) == [running[rid].num_computed_tokens for rid in decode]
    prefill = {r: n for r, n in plan.num_scheduled_tokens.items() if r not in decode}
    assert dict(preview.prefill_chunks) == prefill
    assert preview.prefill_tokens == sum(prefill.values())
    return preview, plan


def _run(s: ContinuousBatchingScheduler, plan: SchedulerOutput, token: int = 7) -> None:
    sampled = {
        rid: token
        for rid, n in plan.num_scheduled_tokens.items()
        if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens
    }
    s.update_from_output(plan, sampled)


def test_preview_of_nothing_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _scheduler(blocks=4)
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert preview.is_empty and plan.is_empty
    assert preview.num_waiting == 0 and preview.new_blocks == 0 and preview.tokens_used == 0
    assert (preview.running_block_demand, preview.waiting_block_demand) == (0, 0)


def test_preview_follows_prefill_chunks_then_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _scheduler(blocks=16, budget=8)
    s.add_request(_request("a", 10))
    s.add_request(_request("b", 3))
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert dict(preview.prefill_chunks) == {"a": 8} and preview.num_waiting == 2
    # a's first chunk needs 2 blocks; b's first chunk, at least one token: 1 block
    assert (preview.running_block_demand, preview.waiting_block_demand) == (0, 3)
    _run(s, plan)
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert dict(preview.num_scheduled_tokens) == {"a": 2, "b": 3}
    assert preview.new_blocks == 2 and preview.running_block_demand == 1
    _run(s, plan)
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert preview.decode_request_ids == ("a", "b") and preview.decode_contexts == (10, 3)
    assert preview.prefill_tokens == 0 and preview.new_blocks == 0  # 11 and 4 tokens fit
    assert preview.tokens_used == 2


def test_preview_stops_where_blocks_and_the_sequence_limit_stop_admission(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = _scheduler(blocks=4, budget=32, seqs=2)
    for rid in ("a", "b", "c"):
        s.add_request(_request(rid, 8, max_tokens=4))
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert dict(preview.num_scheduled_tokens) == {"a": 8, "b": 8}  # c: sequence limit
    _run(s, plan)
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    s.add_request(_request("d", 8))
    # b needs a third block (one of a's two); c's first chunk needs two: only one is left
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert dict(preview.num_scheduled_tokens) == {"b": 1} and preview.new_blocks == 1
    assert (preview.running_block_demand, preview.waiting_block_demand) == (1, 4)


def test_preview_foresees_preemption_and_self_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _scheduler(blocks=4, budget=16, seqs=4)
    for rid in ("a", "b", "c"):
        s.add_request(_request(rid, 4))
    _, plan = _schedule_after_preview(s, monkeypatch)
    _run(s, plan)
    # each needs a 2nd block for its 5th token and one is free: b preempts c and takes its block
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert preview.preempted_request_ids == ("c",) and preview.new_blocks == 2
    # demand: as if nothing were preempted (c's block included)
    assert preview.running_block_demand == 3
    _run(s, plan)
    s2 = _scheduler(blocks=2, budget=16)
    s2.add_request(_request("x", 4, max_tokens=2))
    _run(s2, s2.schedule())
    assert s2.block_manager.shrink(1) == [1]
    preview, plan = _schedule_after_preview(s2, monkeypatch)
    assert preview.preempted_request_ids == ("x",) and preview.is_empty
    assert preview.running_block_demand == 1


def test_preview_asks_adapter_admissibility_without_taking_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held: dict[str, str] = {}
    asked: list[str] = []

    def admissible(request_id: str, name: str) -> bool:
        asked.append(request_id)
        if name == "huge":
            raise AdapterAdmissionError("rank 64 > 8")
        return name in held.values() or not held

    def admit(request_id: str, name: str) -> bool:
        if not admissible(request_id, name):
            return False
        held[request_id] = name
        return True

    s = _scheduler(blocks=16, admit=admit, admissible=admissible)
    s.add_request(_request("a", 4, lora="x"))
    s.add_request(_request("h", 4, lora="huge"))  # can never be served: dropped
    s.add_request(_request("d", 4))
    preview = s.preview()
    assert held == {} and asked == ["a", "h"] and s.take_rejected() == []
    _, plan = _schedule_after_preview(s, monkeypatch)
    assert dict(plan.num_scheduled_tokens) == {"a": 4, "d": 4}
    assert [r.request_id for r in s.take_rejected()] == ["h"] and held == {"a": "x"}
    _run(s, plan)
    s.add_request(_request("b", 4, lora="x"))
    s.add_request(_request("c", 4, lora="y"))  # a second adapter: no slot, c and e wait
    s.add_request(_request("e", 4))
    preview, plan = _schedule_after_preview(s, monkeypatch)
    assert dict(preview.prefill_chunks) == {"b": 4} and preview.decode_request_ids == ("a", "d")
    assert held == {"a": "x", "b": "x"}


def test_views_are_read_only_snapshots() -> None:
    s = _scheduler(blocks=8)
    s.add_request(_request("a", 4))
    s.add_request(_request("b", 4))
    waiting = s.waiting
    assert isinstance(waiting, tuple) and [r.request_id for r in waiting] == ["a", "b"]
    with pytest.raises(TypeError):
        s.requests["c"] = _request("c", 4)  # type: ignore[index]
    with pytest.raises(AttributeError):
        s.running.append(_request("c", 4))  # type: ignore[attr-defined]
    s.schedule()
    assert [r.request_id for r in waiting] == ["a", "b"]  # a snapshot, not the queue
    assert s.waiting == () and [r.request_id for r in s.running] == ["a", "b"]
    assert s.get_request("a") is s.requests["a"]
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert s.get_request("a") is None and "a" not in s.requests


def test_add_running_request_adopts_a_cached_prefix() -> None:
    s = _scheduler(blocks=8)
    request = _request("a", 9)
    s.block_manager.append_slots(request.block_table, 9)
    request.num_computed_tokens = 8
    s.add_running_request(request)
    assert request.status is RequestStatus.RUNNING and s.running == (request,)
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.new_requests[0].block_ids == [0, 1, 2]
    with pytest.raises(ValueError, match="already exists"):
        s.add_running_request(request)


def test_preview_equals_schedule_over_a_random_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrivals, finishes and blocks taken away and given back at random: every step's preview
    is its schedule (prefill chunks, decode rows, admissions, preemptions)."""
    rng = random.Random(11)
    s = _scheduler(blocks=24, budget=12, seqs=5)
    seen: set[str] = set()
    for step in range(300):
        if step % 2 == 0 and step < 200:
            s.add_request(_request(f"r{step}", rng.randint(1, 20), max_tokens=rng.randint(1, 9)))
        if rng.random() < 0.1:
            s.block_manager.shrink(rng.randint(1, 6))
        elif rng.random() < 0.2:
            removed = set(range(24)) - set(s.block_manager.free_block_ids())
            used = {b for r in s.requests.values() for b in r.block_table}
            s.block_manager.grow(sorted(removed - used))
        preview, plan = _schedule_after_preview(s, monkeypatch)
        seen.update(
            kind
            for kind, present in (
                ("decode", preview.decode_request_ids),
                ("prefill", preview.prefill_chunks),
                ("preempt", preview.preempted_request_ids),
                ("empty", preview.is_empty),
            )
            if present
        )
        _run(s, plan)
        for request in s.running:
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                s.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    assert seen == {"decode", "prefill", "preempt", "empty"}
