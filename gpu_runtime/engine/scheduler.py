"""The scheduler contract: what the engine and the other parts of a host may ask a scheduling
policy, and the plans it hands the runner.

The scheduler decides, each step, which requests run and how many of their tokens are computed;
it owns the block manager's allocations and the requests' block tables. It hands the runner one
`SchedulerOutput`: requests the runner has not seen (or must rebuild) in full, the others as
diffs, and the ids whose runner state must be dropped. Other parts (the memory pool, the
co-location policy) read the next step through `preview()` and the read-only views, never the
scheduler's own queues.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

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
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """KV blocks `(src, dst)` the runner copies before the step runs: a fan-out child's own
    copy of the block it shared with its siblings (copy on write, `fanout.py`)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing to compute."""
        return not self.num_scheduled_tokens


@dataclass(frozen=True)
class StepPreview:
    """The next `schedule()`'s plan as figures, computed by the same budget walk, with nothing
    changed (no allocation, no preemption, no adapter slot taken).

    `num_scheduled_tokens`, `preempted_request_ids`, `new_blocks` and `tokens_used` are what the
    next `schedule()` does if nothing changes in between (requests, free blocks, adapter slots).
    The two demand figures are what the memory pool keeps usable: they do not depend on how many
    blocks are free now.
    """

    num_scheduled_tokens: Mapping[str, int]
    """Tokens each scheduled request computes, in batch order."""
    decode_request_ids: tuple[str, ...]
    """Scheduled requests decoding one token (every other token is cached), in batch order."""
    decode_contexts: tuple[int, ...]
    """Cached tokens (KV context) of each decode row, in `decode_request_ids`' order."""
    prefill_chunks: Mapping[str, int]
    """Tokens of each scheduled prefill chunk (running prompts, then admitted ones)."""
    preempted_request_ids: tuple[str, ...]
    """Running requests the step preempts for blocks, in preemption order."""
    new_blocks: int
    """KV blocks the step allocates."""
    tokens_used: int
    """Tokens the step takes out of the token budget (`max_num_batched_tokens`)."""
    num_waiting: int
    """Requests waiting before the step (admitted ones included)."""
    running_block_demand: int = 0
    """Blocks the running requests' next chunks need, as if no request were preempted (what
    must be free for the step to preempt none)."""
    waiting_block_demand: int = 0
    """Blocks the first chunk of every waiting request needs, each chunk at least one token of
    what the budget leaves after the running requests' chunks (what admissions will need)."""

    @property
    def prefill_tokens(self) -> int:
        """Tokens of the step's prefill chunks."""
        return sum(self.prefill_chunks.values())

    @property
    def is_empty(self) -> bool:
        """The step computes nothing."""
        return not self.num_scheduled_tokens


class Scheduler(ABC):
    """Contract between the engine and a scheduling policy.

    - `add_request` queues a request (status WAITING); `abort_request` removes it from any state
      and frees its blocks.
    - `schedule` returns the step's plan; every scheduled request has blocks for
      `num_computed_tokens + num_scheduled_tokens` tokens. It never schedules more than the
      config's token budget or sequence limit.
    - `preview` returns what the next `schedule` would do, from the same walk, and changes
      nothing; readers of the coming step ask it instead of walking the queues themselves.
    - After the runner executed the plan, `update_from_output` advances each scheduled request's
      `num_computed_tokens` and appends the sampled tokens. A request is sampled iff this step
      computed its last known token.
    - `finish_request` ends a request (stop/length) and frees its blocks.
    - `running`, `waiting` and `requests` are read-only views (a snapshot tuple, a mapping
      proxy): callers never change the scheduler's queues through them. The requests they hold
      are the scheduler's own; only the engine writes their sampled tokens back (through
      `update_from_output` and `replace_last_tokens`).
    """

    @property
    @abstractmethod
    def running(self) -> tuple[Request, ...]:
        """Running requests in batch (arrival) order, as of now."""

    @property
    @abstractmethod
    def waiting(self) -> tuple[Request, ...]:
        """Waiting (and preempted) requests in admission order, as of now."""

    @property
    @abstractmethod
    def requests(self) -> Mapping[str, Request]:
        """Every live (waiting or running) request by id; a read-only view."""

    def get_request(self, request_id: str) -> Request | None:
        """The live request `request_id`; None once it finished or was aborted (or never was)."""
        return self.requests.get(request_id)

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def abort_request(self, request_id: str) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def preview(self) -> StepPreview: ...

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> None: ...

    def replace_last_tokens(self, sampled: Mapping[str, int]) -> None:
        """Write the tokens a step sampled in place of the placeholders that
        `update_from_output` appended for them (async scheduling); ids no longer live are
        ignored."""
        requests = self.requests
        for request_id, token in sampled.items():
            request = requests.get(request_id)
            if request is not None:
                request.output_token_ids[-1] = token

    def decode_follows(self, output: SchedulerOutput, max_rows: int) -> bool:
        """True when the step after `output` is sure to decode one token of each of the same
        requests (at most `max_rows` of them), whatever tokens `output` samples: the engine
        may then launch it before `output` is read back. A scheduler that cannot tell answers
        False (the default): no step is launched ahead."""
        return False

    @abstractmethod
    def finish_request(self, request_id: str, status: RequestStatus) -> None: ...

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.requests)

    def take_rejected(self) -> list[Request]:
        """Requests dropped since the last call without running (status FINISHED_ABORTED,
        `stop_reason` = why); the engine reports them as failed. None by default."""
        return []
