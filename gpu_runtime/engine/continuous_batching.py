"""The continuous-batching scheduler: fair admission across tenants (FIFO within one),
chunked prefill, preemption by recomputation.

`schedule()` and `preview()` share one budget walk (`budget_walk.walk_step`), which decides and
changes nothing; `schedule()` then applies its decisions (allocations, preemptions, admissions)
in the order they were taken, so that block ids come out as if each were applied at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.budget_walk import PREEMPT, Walk, step_preview, walk_step
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.fanout import FanOuts, fork_children, waiting_children
from gpu_runtime.engine.prefix_keys import PrefixKeys
from gpu_runtime.engine.request import Request, RequestStatus
from gpu_runtime.engine.scheduler import (
    CachedRequestData,
    NewRequestData,
    Scheduler,
    SchedulerOutput,
    StepPreview,
)
from gpu_runtime.engine.waiting_queue import WaitingQueue


class ContinuousBatchingScheduler(Scheduler):
    """Continuous batching with chunked prefill, preemption by recomputation and admission
    fair across tenants.

    Each step first serves running requests in the order they were admitted (one decode
    token, or the next prefill chunk); when a running request needs a block and none is free,
    the latest-admitted running request is preempted (blocks freed, recomputed later from its
    tokens). Then waiting requests are admitted in the `WaitingQueue`'s order (preempted
    requests first, then new requests one per tenant in turn, FIFO within a tenant: one
    tenant's thousand queued prompts delay another tenant's request by at most one admission)
    while the token budget, the sequence limit and free blocks for their first chunk allow
    (none are admitted in a step that preempted). Admission never skips: the first request in
    that order that does not fit ends the step's admissions. With a single tenant (every
    request's `tenant` the same) the order is FCFS.

    Adapters: a waiting request with a `lora_name` is admitted only when
    `admit_adapter(request_id, lora_name)` returns True (it then holds an adapter slot);
    otherwise admission stops for this step (later requests do not overtake it).
    `release_adapter(request_id)` is called once when an admitted adapter request finishes, is
    aborted or is preempted; a preempted request asks `admit_adapter` again when re-admitted.
    When `admit_adapter` raises `AdapterAdmissionError`, the request is dropped (see
    `take_rejected`) and admission goes on with the next one.
    Without `admit_adapter`, requests with a `lora_name` are admitted like any other.
    `adapter_admissible(request_id, lora_name)` answers as `admit_adapter` would, holding no
    slot: `preview()` asks it (each against the slots as they are before the step, so a step
    that loads several new adapters may admit fewer than previewed); without it, `preview()`
    counts adapter requests as admitted.

    Prefix caching (`config.enable_prefix_caching`, `PrefixKeys`): once a step has computed a
    request's full blocks, they are named by their digests in the block manager's cache; a
    waiting request (new or preempted) is admitted with the longest cached prefix of its
    tokens in whole blocks, never its last token (`Request.num_computed_tokens` starts there;
    a new request's `num_cached_tokens` records it), so its first chunk starts at the first
    uncached token. Its table then shares those blocks with other requests (ref counts); a
    finished, aborted or preempted request's cached blocks become evictable, not empty. A
    block's digest covers the request's adapter: requests of different adapters (or the base
    model) never share a block. Hits are found only on blocks computed by earlier steps.

    Fan-out (`Request.fan_out > 1`, `fanout.py`): a parent is admitted as its `fan_out`
    sequences; `update_from_output` forks it into its children once its prompt but the last
    token is cached; aborting the parent's id aborts the parent or every live child.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        admit_adapter: Callable[[str, str], bool] | None = None,
        release_adapter: Callable[[str], None] | None = None,
        adapter_admissible: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.admit_adapter = admit_adapter
        self.release_adapter = release_adapter
        self.adapter_admissible = adapter_admissible
        self._adapter_holders: set[str] = set()
        self._rejected: list[Request] = []
        self._waiting = WaitingQueue()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._requests_view = MappingProxyType(self._requests)
        self._known_to_runner: set[str] = set()
        self._drop_from_runner: set[str] = set()
        self.prefix_keys: PrefixKeys | None = (
            PrefixKeys(block_manager) if config.enable_prefix_caching else None
        )
        """Block digests of the live requests (None: prefix caching off)."""
        self._fan_outs = FanOuts()

    # ---- read-only views --------------------------------------------------------------------
    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def requests(self) -> Mapping[str, Request]:
        return self._requests_view

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} already exists")
        total = len(request.prompt_token_ids) + request.sampling_params.max_tokens
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if request.fan_out > self.config.max_num_seqs:
            raise ValueError(
                f"n={request.fan_out} > max_num_seqs={self.config.max_num_seqs}: a "
                "request's n sequences are admitted together"
            )
        if request.fan_out > 1 and len(request.prompt_token_ids) == 1:
            children = waiting_children(request)  # no prompt prefix to share
            for child in children:
                self.add_request(child)
            self._fan_outs.forked(request.request_id, children)
            return
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {total} > max_model_len="
                f"{self.config.max_model_len}"
            )
        # Checked against the storage capacity, not the usable count: a memory pool moves the
        # usable count at run time and maps blocks back in when decode needs them.
        needed = self.block_manager.blocks_for_tokens(total)
        if needed > self.block_manager.capacity:
            raise ValueError(
                f"request needs {needed} KV blocks, the KV storage holds "
                f"{self.block_manager.capacity}"
            )
        if (
            not self.config.enable_chunked_prefill
            and len(request.prompt_token_ids) > self.config.max_num_batched_tokens
        ):
            raise ValueError(
                f"prompt of {len(request.prompt_token_ids)} tokens exceeds "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}"
            )
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.add(request)

    def add_running_request(self, request: Request) -> None:
        """Adopt `request` as running, its first `num_computed_tokens` tokens already cached in
        the blocks of its `block_table` (allocated from this scheduler's block manager): a
        benchmark starts from a steady decode batch this way. Its adapter, if any, is admitted
        through `admit_adapter`; ValueError when it cannot be at once."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} already exists")
        lora = request.lora_name
        if lora is not None and self.admit_adapter is not None:
            if not self.admit_adapter(rid, lora):
                raise ValueError(f"no adapter slot for {lora!r} now")
            self._adapter_holders.add(rid)
        request.status = RequestStatus.RUNNING
        self._requests[rid] = request
        self._running.append(request)

    def _release(self, request: Request) -> None:
        self.block_manager.free(request.block_table)
        request.block_table = []
        if request.cow_source is not None:
            self.block_manager.free([request.cow_source])
            request.cow_source = None
        if request.request_id in self._adapter_holders:
            self._adapter_holders.discard(request.request_id)
            if self.release_adapter is not None:
                self.release_adapter(request.request_id)
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._drop_from_runner.add(request.request_id)
        if self.prefix_keys is not None:
            self.prefix_keys.released(request.request_id)

    def _preempt(self, request: Request) -> None:
        self._fan_outs.stopped(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._waiting.add_preempted(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.pop(request_id)
        if request in self._running:
            self._running.remove(request)
            self._fan_outs.stopped(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        self._release(request)
        if self.prefix_keys is not None:
            self.prefix_keys.forget(request_id)
        request.status = status
        self._fan_outs.finished(request)

    def abort_request(self, request_id: str) -> None:
        """Abort `request_id`; a forked parent's id aborts each of its live children."""
        if request_id in self._requests:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        for child in self._fan_outs.children(request_id):
            if child in self._requests:
                self.finish_request(child, RequestStatus.FINISHED_ABORTED)

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        walk = self._walk(self.admit_adapter)
        bm = self.block_manager
        known = self._known_to_runner
        cached_data: list[CachedRequestData] = []
        copies: list[tuple[int, int]] = []
        for request, blocks in walk.block_moves:
            if blocks == PREEMPT:
                self._running.pop()  # the victim is the last running request
                self._preempt(request)
                continue
            new_blocks = bm.allocate(blocks)
            if request.cow_source is not None:  # a fan-out child's own copy of a shared block
                copies.append((request.cow_source, new_blocks[0]))
                bm.free([request.cow_source])
                request.cow_source = None
            request.block_table.extend(new_blocks)
            rid = request.request_id
            if rid in known:
                cached_data.append(CachedRequestData(rid, new_blocks, request.num_computed_tokens))
        new_data = [self._new_request_data(request) for request in walk.unknown_running]
        holds_slots = self.admit_adapter is not None
        for request, reason in walk.admissions:
            if self._waiting.pop_first() is not request:  # the walk takes a prefix of the order
                raise RuntimeError(f"admission of {request.request_id!r} out of queue order")
            if reason is not None:
                self._reject(request, reason)
                continue
            if holds_slots and request.lora_name is not None:
                self._adapter_holders.add(request.request_id)
            hits = walk.cache_hits.get(request.request_id)
            if hits is not None and self.prefix_keys is not None:
                self.prefix_keys.admit(request, hits)
            count = walk.num_scheduled[request.request_id]
            bm.append_slots(request.block_table, request.num_computed_tokens + count)
            self._fan_outs.started(request)
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            new_data.append(self._new_request_data(request))
        finished = self._drop_from_runner
        self._drop_from_runner = set()
        return SchedulerOutput(
            new_data, cached_data, walk.num_scheduled, finished, walk.preempted, copies
        )

    def preview(self) -> StepPreview:
        admit = self.adapter_admissible if self.admit_adapter is not None else None
        walk = self._walk(admit)
        block_size, budget = self.block_manager.block_size, self.config.max_num_batched_tokens
        return step_preview(walk, self._running, self._waiting, block_size, budget)

    def _walk(self, admit: Callable[[str, str], bool] | None) -> Walk:
        return walk_step(
            self._running,
            self._waiting,
            self._known_to_runner,
            self.block_manager,
            self.config,
            admit,
            self.prefix_keys.hits if self.prefix_keys is not None else None,
            self._fan_outs.pending_children,
        )

    def decode_follows(self, output: SchedulerOutput, max_rows: int) -> bool:
        """True when every running request was sampled by `output` (at most `max_rows`), none
        reaches its `max_tokens` or `max_model_len` with that token, no request waits (no
        admission), and free blocks cover every row's next token (no preemption)."""
        if self._waiting:
            return False
        running = self._running
        scheduled = output.num_scheduled_tokens
        if not running or len(running) != len(scheduled) or len(running) > max_rows:
            return False
        block_size = self.block_manager.block_size
        limit = self.config.max_model_len
        needed = 0
        for request in running:
            count = scheduled.get(request.request_id)
            tokens = request.num_tokens
            if count is None or request.num_computed_tokens + count != tokens:
                return False  # not sampled by this step (a chunk of a longer prompt)
            if (
                len(request.output_token_ids) + 1 >= request.sampling_params.max_tokens
                or tokens + 1 >= limit
            ):
                return False  # stops on length with this step's token
            if tokens + 1 > len(request.block_table) * block_size:
                needed += 1
        return self.block_manager.can_allocate(needed)

    def _reject(self, request: Request, reason: str) -> None:
        """Drop `request` (already off the waiting queue) as `admit_adapter` refused it."""
        del self._requests[request.request_id]
        self._fan_outs.finished(request)
        self._release(request)  # a preempted request may still be known to the runner
        if self.prefix_keys is not None:
            self.prefix_keys.forget(request.request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = reason
        self._rejected.append(request)

    def take_rejected(self) -> list[Request]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def _new_request_data(self, request: Request) -> NewRequestData:
        self._known_to_runner.add(request.request_id)
        return NewRequestData(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            block_ids=list(request.block_table),
            num_computed_tokens=request.num_computed_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=len(request.output_token_ids),
            lora_name=request.lora_name,
        )

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        requests = self._requests  # finished and aborted requests are no longer in it
        keys = self.prefix_keys
        for request_id, count in output.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None:
                continue
            request.num_computed_tokens += count
            if keys is not None:
                keys.computed(request)
            forks = request.fan_out > 1
            if forks and request.num_computed_tokens == request.num_schedulable_tokens:
                self._fork(request)
                continue
            token = sampled.get(request_id)
            if token is not None:
                request.output_token_ids.append(token)

    def _fork(self, parent: Request) -> None:
        """Replace the running fan-out `parent` by its children, at its place in the batch
        (the fork point, `fanout.py`); the parent's references and runner state are dropped."""
        children = fork_children(parent, self.block_manager)
        lora = parent.lora_name
        if lora is not None and parent.request_id in self._adapter_holders:
            assert self.admit_adapter is not None  # resident: the parent holds it
            for child in children:
                if not self.admit_adapter(child.request_id, lora):
                    raise RuntimeError(f"adapter {lora!r} not resident at the fork")
                self._adapter_holders.add(child.request_id)
        place = self._running.index(parent)
        self._running[place : place + 1] = children
        del self._requests[parent.request_id]
        self._release(parent)
        if self.prefix_keys is not None:  # the children name their own blocks from here on
            self.prefix_keys.forget(parent.request_id)
        self._fan_outs.stopped(parent)
        parent.status = RequestStatus.FINISHED_STOPPED
        for child in children:
            self._requests[child.request_id] = child
        self._fan_outs.forked(parent.request_id, children)
