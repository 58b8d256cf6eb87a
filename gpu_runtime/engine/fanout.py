"""Request fan-out (`SamplingParams.n > 1`): one parent prefilled once, forked into n children
that share its KV blocks.

The parent computes every prompt token but the last (`Request.num_schedulable_tokens`) and never
samples. Then `fork_children` replaces it by n ordinary requests over the same prompt, each with
`num_computed_tokens = len(prompt) - 1`: each computes the last prompt token itself (one decode
row, so the n first tokens are sampled independently in the batched sampler) and goes on
alone. Their block tables share the parent's blocks by reference count
(`BlockManager.fork`). When the cached prefix ends inside a block, that block is written by
every child (its last prompt token, then its own tokens): child 0 keeps it, and each other child
holds one reference on it as its `cow_source` with a table that stops before it, so the
scheduler's budget walk allocates the child a block of its own there (or preempts for one, as
for any running request); the scheduler then asks the runner to copy the source into it before
the step runs (`SchedulerOutput.block_copies`) and drops the reference. A cached prefix that
ends on a block boundary needs no copy: every child's next token opens a new block.

Seeds: child 0 keeps the request's seed, child i > 0 gets `child_seed(seed, i)`, so n = 2 with
a seed is reproducible and its first choice is the n = 1 answer.
"""

from __future__ import annotations

import dataclasses

from gpu_runtime.engine.block_manager import BlockManager
from gpu_runtime.engine.request import Request, RequestStatus

_CHILD_SEED_MIX = 0xD1B54A32D192ED03


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of child `index` of a request seeded `seed` (None stays None: unseeded
    children draw from the sampler's generator, one row each)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _CHILD_SEED_MIX) % (1 << 63)


def child_id(parent_id: str, index: int) -> str:
    """The request id of child `index` of `parent_id`."""
    return f"{parent_id}#{index}"


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of the sequences a request of `n` samples under: itself, or its children."""
    return [request_id] if n == 1 else [child_id(request_id, i) for i in range(n)]


def waiting_children(parent: Request) -> list[Request]:
    """The `fan_out` children of a parent with a one-token prompt (nothing to share: each
    computes the token itself), waiting, in place of the parent."""
    params = dataclasses.replace(parent.sampling_params, n=1)
    return [
        Request(
            child_id(parent.request_id, index),
            parent.prompt_token_ids,
            dataclasses.replace(params, seed=child_seed(params.seed, index)),
            lora_name=parent.lora_name,
            tenant=parent.tenant,
            arrival_time=parent.arrival_time,
            parent_id=parent.request_id,
            index=index,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )
        for index in range(parent.fan_out)
    ]


def fork_children(parent: Request, block_manager: BlockManager) -> list[Request]:
    """The parent's `fan_out` children, running, their tables forked from the parent's (see
    the module doc); the parent's own references are left for the caller to free. The parent
    must have computed exactly `num_schedulable_tokens` tokens and generated none."""
    cached = parent.num_computed_tokens
    if parent.fan_out < 2 or parent.output_token_ids or cached != parent.num_schedulable_tokens:
        raise ValueError(
            f"request {parent.request_id!r} cannot fork: fan_out={parent.fan_out}, "
            f"{cached} cached of {parent.num_schedulable_tokens}, "
            f"{len(parent.output_token_ids)} generated"
        )
    table = parent.block_table
    partial = cached % block_manager.block_size != 0
    shared = table[:-1] if partial else table
    params = dataclasses.replace(parent.sampling_params, n=1)
    children = []
    for index in range(parent.fan_out):
        child_params = dataclasses.replace(params, seed=child_seed(params.seed, index))
        if index == 0 or not partial:
            child_table = block_manager.fork(table)
            source = None
        else:
            child_table = block_manager.fork(shared)
            source = block_manager.fork(table[-1:])[0]
        child = Request(
            child_id(parent.request_id, index),
            parent.prompt_token_ids,
            child_params,
            lora_name=parent.lora_name,
            tenant=parent.tenant,
            arrival_time=parent.arrival_time,
            num_computed_tokens=cached,
            block_table=child_table,
            status=RequestStatus.RUNNING,
            parent_id=parent.request_id,
            index=index,
            cow_source=source,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )
        children.append(child)
    return children


class FanOuts:
    """The scheduler's fan-out bookkeeping: the sequences running parents add when they fork
    (admission counts them against `max_num_seqs`) and each parent id's live children (what
    aborting that id aborts)."""

    def __init__(self) -> None:
        self.pending_children = 0
        """`fan_out - 1` summed over running parents (admitted, not forked yet)."""
        self._children: dict[str, list[str]] = {}

    def started(self, request: Request) -> None:
        """`request` was admitted (running)."""
        self.pending_children += request.fan_out - 1

    def stopped(self, request: Request) -> None:
        """Running `request` stopped running: preempted, finished or forked."""
        self.pending_children -= request.fan_out - 1

    def forked(self, parent_id: str, children: list[Request]) -> None:
        """`children` replace `parent_id` (running, or waiting for a one-token prompt)."""
        self._children[parent_id] = [child.request_id for child in children]

    def finished(self, request: Request) -> None:
        """A live request ended (finished, aborted, dropped): a child leaves its parent's."""
        siblings = self._children.get(request.parent_id or "")
        if siblings is not None and request.request_id in siblings:
            siblings.remove(request.request_id)
            if not siblings:
                del self._children[request.parent_id or ""]

    def children(self, parent_id: str) -> list[str]:
        """The live children of `parent_id` (none before its fork)."""
        return list(self._children.get(parent_id, ()))
