"""The sampling of a launched step's logits and the read-back of its tokens.

`StepReadback` is held by `ModelRunner`. Per launched step it queues the sampling, the copies of
the sampled tokens (and logprobs, when asked) to the host and a CUDA event after them, and marks
the sampled states as holding `UNRESOLVED_TOKEN`; `read_back` waits for that event (the step's
one host sync) and writes the tokens into the states. It keeps the last launched step, whose
tokens the next step may read on the device (`pending_inputs`).

Sampled tokens come back through two pinned buffers used in turn: no allocation per step, and a
launch never overwrites the buffer of the step launched just before it.

Rows with a presence, frequency or repetition penalty read their token counts from `counts`
(`TokenCounts`), and the token each such row samples is counted there on the device right
after sampling: a step launched before this one is read back already sees it.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gpu_runtime.engine.request import TokenLogprob
from gpu_runtime.engine.runner_types import (
    UNRESOLVED_TOKEN,
    PendingTokens,
    StepHandle,
    _RequestState,
)
from gpu_runtime.engine.sampler import RowCounts, Sampler, SamplingBatch
from gpu_runtime.engine.token_counts import TokenCounts, to_device
from gpu_runtime.structured.outputs import StructuredOutputs


class StepReadback:
    """Sampling, copies back and read-back of launched steps of at most `max_rows` rows."""

    def __init__(
        self,
        sampler: Sampler,
        device: torch.device,
        max_rows: int,
        pin: bool,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """`structured`: the engine's grammar matchers; constrained rows' logits are masked
        before sampling (steps without constrained rows are not touched)."""
        self.sampler = sampler
        self.structured = structured
        self.device = device
        self._hosts = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._parity = 0
        self.last_launched: StepHandle | None = None
        """The last step queued with sampled rows (resolved or not)."""
        self.counts = TokenCounts(device, max_rows)
        """Token counts of the penalised requests' rows."""

    def queue(
        self,
        handle: StepHandle,
        logits: torch.Tensor,
        sampled_ids: list[str],
        states: list[_RequestState],
    ) -> None:
        """Sample `logits` `[rows, vocab]` for `states` (ids `sampled_ids`, row order), queue
        the copies back and the step's event, and count each state's new token as
        `UNRESOLVED_TOKEN` (pending on `handle`)."""
        batch = SamplingBatch(
            [s.sampling_params for s in states], [s.num_output_tokens for s in states]
        )
        if self.structured is not None:
            self.structured.constrain(logits, sampled_ids)
        penalised = batch.penalised_rows
        counts: RowCounts | None = None
        if penalised:
            rows = self.counts.prepare([states[i] for i in penalised], logits.shape[-1])
            assert self.counts.output is not None and self.counts.prompt is not None
            counts = (self.counts.output, self.counts.prompt, rows)
        sample = self.sampler.sample(logits, batch, counts)
        if penalised:
            sampled = sample.token_ids
            if len(penalised) != len(states):
                sampled = sampled[to_device(np.array(penalised, np.int64), self.device)]
            self.counts.add(rows, sampled)
        num_sampled = len(sampled_ids)
        self._parity ^= 1
        token_host = self._hosts[self._parity][:num_sampled]
        token_host.copy_(sample.token_ids, non_blocking=True)
        extra = [sample.logprobs, sample.top_token_ids, sample.top_logprobs]
        copies = [t.to("cpu", non_blocking=True) if t is not None else None for t in extra]
        if self.device.type == "cuda":
            handle.event = torch.cuda.Event()
            handle.event.record()
        step = handle.step
        positions = handle.positions
        for index, state in enumerate(states):
            positions.append(len(state.token_ids))
            state.token_ids.append(UNRESOLVED_TOKEN)
            state.num_output_tokens += 1
            state.pending_step = step
            state.pending_index = index
        handle.sampled_ids = sampled_ids
        handle.states = states
        handle.token_ids = sample.token_ids
        handle.token_host = token_host
        handle.logprob_copies = copies
        self.last_launched = handle

    def read_back(self, handle: StepHandle) -> float:
        """Wait for an unresolved step (its event: later launches keep running), write its
        tokens into the states and its host results; returns the seconds waited."""
        handle.resolved = True
        waiting = time.perf_counter()
        if handle.event is not None:
            handle.event.synchronize()
        handle.device_done = True
        waited = time.perf_counter() - waiting
        assert handle.token_host is not None
        tokens = handle.token_host.tolist()
        result = handle.result
        sampled = result.sampled
        states = handle.states
        for rid, state, position, token in zip(
            handle.sampled_ids, states, handle.positions, tokens, strict=True
        ):
            state.token_ids[position] = token
            sampled[rid] = token
        copies = handle.logprob_copies
        if copies[0] is None:
            return waited
        for i, (rid, state) in enumerate(zip(handle.sampled_ids, states, strict=True)):
            if state.sampling_params.logprobs is not None:
                top: tuple[tuple[int, float], ...] = ()
                wanted = state.sampling_params.logprobs
                if wanted and copies[1] is not None and copies[2] is not None:
                    top = tuple(
                        zip(
                            copies[1][i, :wanted].tolist(),
                            copies[2][i, :wanted].tolist(),
                            strict=True,
                        )
                    )
                result.logprobs[rid] = TokenLogprob(tokens[i], float(copies[0][i]), top)
        return waited

    def pending_inputs(self, states: list[_RequestState]) -> PendingTokens | None:
        """Rows whose last token is still on the device: the unresolved step's sampled tensor
        and, per row, the index into it (-1: the token is on the host)."""
        last = self.last_launched
        if last is None or last.resolved or last.token_ids is None:
            return None
        step = last.step
        source = np.fromiter(
            (s.pending_index if s.pending_step == step else -1 for s in states),
            np.int64,
            len(states),
        )
        if (source < 0).all():
            return None
        return last.token_ids, source

    def wait_for_launched(self) -> None:
        """Wait until the device has finished the last launched step, also when it was
        discarded, not resolved. No-op when already waited for, or on CPU."""
        last = self.last_launched
        if last is not None and not last.device_done:
            if last.event is not None:
                last.event.synchronize()
            last.device_done = True
