"""Scheduler contract and the continuous-batching implementation.

The scheduler decides, each step, which requests run and how many of their tokens are computed;
it owns the block manager and the requests' block tables. It hands the runner one
`SchedulerOutput`: requests the runner has not seen (or must rebuild) in full, the others as
diffs, and the ids whose runner state must be dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.config import EngineConfig
from gpu_runtime.engine.request import Request, RequestStatus, SamplingParams


class AdapterAdmissionError(ValueError):
    """`admit_adapter` cannot ever serve the request's adapter (e.g. its rank exceeds the slots);
    the scheduler drops the request and reports it through `take_rejected`."""


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner must (re)build: every known token and its whole block table."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_output_tokens: int
    lora_name: str | None = None


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds that got new blocks this step (requests without new
    blocks appear only in `num_scheduled_tokens`; the runner advances them itself)."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. `num_scheduled_tokens` is in batch order (its key order)."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests finished, aborted or preempted since the last step: drop their runner state."""
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing to compute."""
        return not self.num_scheduled_tokens


class Scheduler(ABC):
    """Contract between the engine and a scheduling policy.

    - `add_request` queues a request (status WAITING); `abort_request` removes it from any state
      and frees its blocks.
    - `schedule` returns the step's plan; every scheduled request has blocks for
      `num_computed_tokens + num_scheduled_tokens` tokens. It never schedules more than the
      config's token budget or sequence limit.
    - After the runner executed the plan, `update_from_output` advances each scheduled request's
      `num_computed_tokens` and appends the sampled tokens. A request is sampled iff this step
      computed its last known token.
    - `finish_request` ends a request (stop/length) and frees its blocks.
    """

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def abort_request(self, request_id: str) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> None: ...

    @abstractmethod
    def finish_request(self, request_id: str, status: RequestStatus) -> None: ...

    @abstractmethod
    def get_request(self, request_id: str) -> Request: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    def take_rejected(self) -> list[Request]:
        """Requests dropped since the last call without running (status FINISHED_ABORTED,
        `stop_reason` = why); the engine reports them as failed. None by default."""
        return []


class ContinuousBatchingScheduler(Scheduler):
    """FCFS continuous batching with chunked prefill and preemption by recomputation.

    Each step first serves running requests in arrival order (one decode token, or the next
    prefill chunk); when a running request needs a block and none is free, the latest-arrived
    running request is preempted (blocks freed, recomputed later from its tokens). Then waiting
    requests are admitted while the token budget, the sequence limit and free blocks for their
    first chunk allow (none are admitted in a step that preempted).

    Adapters: a waiting request with a `lora_name` is admitted only when
    `admit_adapter(request_id, lora_name)` returns True (it then holds an adapter slot);
    otherwise admission stops for this step (FCFS: later requests do not overtake it).
    `release_adapter(request_id)` is called once when an admitted adapter request finishes, is
    aborted or is preempted; a preempted request asks `admit_adapter` again when re-admitted.
    When `admit_adapter` raises `AdapterAdmissionError`, the request is dropped (see
    `take_rejected`) and admission goes on with the next one.
    Without `admit_adapter`, requests with a `lora_name` are admitted like any other.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        admit_adapter: Callable[[str, str], bool] | None = None,
        release_adapter: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.admit_adapter = admit_adapter
        self.release_adapter = release_adapter
        self._adapter_holders: set[str] = set()
        self._rejected: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._drop_from_runner: set[str] = set()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} already exists")
        total = len(request.prompt_token_ids) + request.sampling_params.max_tokens
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
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
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def get_request(self, request_id: str) -> Request:
        return self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, request: Request) -> None:
        self.block_manager.free(request.block_table)
        request.block_table = []
        if request.request_id in self._adapter_holders:
            self._adapter_holders.discard(request.request_id)
            if self.release_adapter is not None:
                self.release_adapter(request.request_id)
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._drop_from_runner.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = status

    def abort_request(self, request_id: str) -> None:
        if request_id in self.requests:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_data: list[NewRequestData] = []
        cached_data: list[CachedRequestData] = []
        preempted: list[str] = []
        bm = self.block_manager

        block_size = bm.block_size
        known = self._known_to_runner
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            computed = request.num_computed_tokens
            count = request.num_tokens - computed
            if count > budget:
                count = budget
            target = computed + count
            table = request.block_table
            needed = -(-target // block_size) - len(table)
            if needed > 0:
                self_preempted = False
                while not bm.can_allocate(needed):
                    victim = self.running.pop()
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        self_preempted = True
                        break
                if self_preempted:
                    break
                new_blocks = bm.allocate(needed)
                table.extend(new_blocks)
            else:
                new_blocks = []
            rid = request.request_id
            num_scheduled[rid] = count
            budget -= count
            if rid not in known:
                new_data.append(self._new_request_data(request))
            elif new_blocks:
                cached_data.append(CachedRequestData(rid, new_blocks, computed))
            index += 1

        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            count = min(request.num_tokens, budget)
            if not bm.can_allocate(bm.blocks_for_tokens(count)):
                break
            lora = request.lora_name
            if lora is not None and self.admit_adapter is not None:
                try:
                    admitted = self.admit_adapter(request.request_id, lora)
                except AdapterAdmissionError as exc:
                    self._reject(request, str(exc))
                    continue
                if not admitted:
                    break  # every adapter slot is held by running requests: wait (FCFS)
                self._adapter_holders.add(request.request_id)
            self.waiting.popleft()
            bm.append_slots(request.block_table, count)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = count
            budget -= count
            new_data.append(self._new_request_data(request))

        finished = self._drop_from_runner
        self._drop_from_runner = set()
        return SchedulerOutput(new_data, cached_data, num_scheduled, finished, preempted)

    def _reject(self, request: Request, reason: str) -> None:
        self.waiting.popleft()
        del self.requests[request.request_id]
        self._release(request)  # a preempted request may still be known to the runner
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
        requests = self.requests  # finished and aborted requests are no longer in it
        for request_id, count in output.num_scheduled_tokens.items():
            request = requests.get(request_id)
            if request is None:
                continue
            request.num_computed_tokens += count
            token = sampled.get(request_id)
            if token is not None:
                request.output_token_ids.append(token)
