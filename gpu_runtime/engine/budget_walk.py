"""The continuous-batching scheduler's budget walk: the next step's decisions over its queues,
taken without changing them, and the `StepPreview` figures they give.

`ContinuousBatchingScheduler.schedule()` applies a walk's decisions (in the order they were
taken, so that block ids come out as if each were applied at once); `preview()` reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.request import Request
from gpu_runtime.engine.scheduler import AdapterAdmissionError, StepPreview
from gpu_runtime.engine.walk_blocks import WalkBlocks

PrefixHits = Callable[[Request], list[int]]
"""Cached blocks holding a waiting request's first tokens (`PrefixCache.lookup` over its block
digests, at most `(num_tokens - 1) // block_size` blocks: its last token is always computed)."""

PREEMPT = -1
"""`Walk.block_moves` entry: preempt the request (the last running one at that point)."""


@dataclass
class Walk:
    """Decisions of one budget walk, in the order `schedule` applies them."""

    num_scheduled: dict[str, int] = field(default_factory=dict)
    """Tokens per scheduled request, in batch order."""
    block_moves: list[tuple[Request, int]] = field(default_factory=list)
    """`(running request, n > 0)`: allocate it n blocks; `(victim, PREEMPT)`: preempt it."""
    unknown_running: list[Request] = field(default_factory=list)
    """Scheduled running requests the runner does not hold (sent in full)."""
    admissions: list[tuple[Request, str | None]] = field(default_factory=list)
    """Waiting requests from the front of the queue: admitted (None) or dropped (the reason)."""
    cache_hits: dict[str, list[int]] = field(default_factory=dict)
    """Admitted requests' prefix-cache hits: the cached blocks their tables start with."""
    preempted: list[str] = field(default_factory=list)
    new_blocks: int = 0
    running_scheduled: int = 0
    """Running requests scheduled: `running[:running_scheduled]`."""
    budget_after_running: int = 0
    budget_left: int = 0
    running_block_demand: int = 0
    """Blocks of the scheduled running requests' chunks."""


def walk_step(
    running: Sequence[Request],
    waiting: Iterable[Request],
    known_to_runner: Container[str],
    block_manager: BlockManager,
    config: EngineConfig,
    admit: Callable[[str, str], bool] | None,
    prefix_hits: PrefixHits | None = None,
    pending_children: int = 0,
) -> Walk:
    """The next step's decisions, changing nothing but what `admit` does (it is asked about
    each waiting adapter request reached, in order; raising `AdapterAdmissionError` drops the
    request). `waiting` is walked from its start in admission order (the scheduler's
    `WaitingQueue`); the admissions are a prefix of it. Free blocks are counted as the
    decisions would leave them (`WalkBlocks`); a preempted request frees the blocks whose last
    reference it holds.

    Running requests in order take their next chunk (one token when decoding) out of the
    token budget; one that needs blocks when too few are free preempts the latest running
    requests until enough are (itself last). Then, unless the step preempted, waiting requests
    are admitted while the budget, `max_num_seqs`, free blocks for their first chunk and
    `admit` allow. With `prefix_hits`, an admitted request starts after its cache hit (whole
    blocks, `Walk.cache_hits`): its first chunk is the first uncached token on, and the hit's
    cached free blocks count against the free blocks like new ones. A fan-out parent counts
    as its `fan_out` sequences; `pending_children`: the sequences running parents add when
    they fork (`fan_out - 1` each). A preempted fan-out child also drops its copy-on-write
    source."""
    walk = Walk()
    scheduled = walk.num_scheduled
    moves = walk.block_moves
    block_size = block_manager.block_size
    blocks = WalkBlocks(block_manager)
    budget = config.max_num_batched_tokens
    end = len(running)  # running[:end] stay running; the walk preempts from the end
    index = 0
    while index < end and budget > 0:
        request = running[index]
        computed = request.num_computed_tokens
        count = request.num_schedulable_tokens - computed
        if count > budget:
            count = budget
        needed = -(-(computed + count) // block_size) - len(request.block_table)
        if needed > 0:
            if needed > blocks.free:
                while needed > blocks.free:
                    end -= 1
                    victim = running[end]
                    blocks.release(_held(victim))
                    moves.append((victim, PREEMPT))
                    walk.preempted.append(victim.request_id)
                    if victim is request:
                        break
                if end == index:  # the request preempted itself
                    break
            blocks.take(needed)
            moves.append((request, needed))
            walk.new_blocks += needed
            walk.running_block_demand += needed
        rid = request.request_id
        scheduled[rid] = count
        budget -= count
        if rid not in known_to_runner:
            walk.unknown_running.append(request)
        index += 1
    walk.running_scheduled = index
    walk.budget_after_running = budget
    num_running = end + pending_children  # a fan-out parent runs as its children
    for request in waiting:
        if budget <= 0 or walk.preempted or num_running + request.fan_out > config.max_num_seqs:
            break
        hits: list[int] = []
        from_free = 0
        if prefix_hits is not None:
            hits, from_free = blocks.usable_hits(prefix_hits(request))
        cached = len(hits) * block_size
        count = min(request.num_schedulable_tokens - cached, budget)
        new = -(-(cached + count) // block_size) - len(hits)
        if new + from_free > blocks.free:
            break
        lora = request.lora_name
        if lora is not None and admit is not None:
            try:
                admitted = admit(request.request_id, lora)
            except AdapterAdmissionError as exc:
                walk.admissions.append((request, str(exc)))
                continue
            if not admitted:
                break  # every adapter slot is held by running requests: wait (no skipping)
        walk.admissions.append((request, None))
        if hits:
            blocks.claim(hits)
            walk.cache_hits[request.request_id] = hits
        blocks.take(new)
        walk.new_blocks += new
        num_running += request.fan_out
        scheduled[request.request_id] = count
        budget -= count
    walk.budget_left = budget
    return walk


def _held(request: Request) -> list[int]:
    """The blocks `request` references: its table and its copy-on-write source, if any."""
    if request.cow_source is None:
        return request.block_table
    return [*request.block_table, request.cow_source]


def step_preview(
    walk: Walk,
    running: Sequence[Request],
    waiting: Collection[Request],
    block_size: int,
    token_budget: int,
) -> StepPreview:
    """The figures of `walk`, taken over `running` and `waiting` (the queues it walked)."""
    scheduled = walk.num_scheduled
    decode_ids: list[str] = []
    contexts: list[int] = []
    chunks: dict[str, int] = {}
    for request in running[: walk.running_scheduled]:
        rid = request.request_id
        if request.num_tokens - request.num_computed_tokens == 1:
            decode_ids.append(rid)
            contexts.append(request.num_computed_tokens)
        else:
            chunks[rid] = scheduled[rid]
    for request, reason in walk.admissions:
        if reason is None:
            chunks[request.request_id] = scheduled[request.request_id]
    # demand: the walk goes on over the requests it preempted or did not reach, as if blocks
    # were free, then every waiting request's first chunk takes at least one token
    running_demand, budget = walk.running_block_demand, walk.budget_after_running
    for request in running[walk.running_scheduled :]:
        if budget <= 0:
            break
        computed = request.num_computed_tokens
        count = min(request.num_schedulable_tokens - computed, budget)
        needed = -(-(computed + count) // block_size) - len(request.block_table)
        if needed > 0:
            running_demand += needed
        budget -= count
    waiting_demand = 0
    for request in waiting:
        computed = request.num_computed_tokens
        chunk = min(request.num_schedulable_tokens - computed, max(budget, 1))
        waiting_demand += -(-(computed + chunk) // block_size)
        budget -= chunk
    return StepPreview(
        num_scheduled_tokens=MappingProxyType(scheduled),
        decode_request_ids=tuple(decode_ids),
        decode_contexts=tuple(contexts),
        prefill_chunks=MappingProxyType(chunks),
        preempted_request_ids=tuple(walk.preempted),
        new_blocks=walk.new_blocks,
        tokens_used=token_budget - walk.budget_left,
        num_waiting=len(waiting),
        running_block_demand=running_demand,
        waiting_block_demand=waiting_demand,
    )
