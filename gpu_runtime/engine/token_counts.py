"""Per-request-row token counts on the device, for the presence, frequency and repetition
penalties.

Counts are kept incrementally: a row's counts are built once, at the first step that samples
its request (the prompt's tokens as a mask, the output so far as counts: a request resumed
after a preemption keeps its earlier output), and each step adds the token it sampled on the
device, right after sampling. So the counts a step reads include every earlier step's token,
also the token of a step still in flight under async scheduling (never read back to the host
before the next step samples), and the per-step host work is O(rows), not O(tokens). The
alternative, a padded `[B, L]` id tensor built on the host each step and scattered into
`[B, V]`, costs O(B x L) host work and copies per step and cannot see the token in flight
(README, "Penalty counts").

Memory: `[rows, V]` int32 counts and `[rows, V]` bool prompt mask (about 165 MB for 257 rows
of a 128k vocabulary), allocated at the first penalised request; engines that never see one
allocate nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_runtime.engine.runner_types import UNRESOLVED_TOKEN, _RequestState


class TokenCounts:
    """Output counts and prompt masks of up to `rows` request rows (`_RequestState.row`)."""

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device = device
        self.rows = rows
        self.output: torch.Tensor | None = None
        """`[rows, V]` int32: how often each token is in the row's output."""
        self.prompt: torch.Tensor | None = None
        """`[rows, V]` bool: the token is in the row's prompt."""
        self._owners: list[_RequestState | None] = [None] * rows
        """The state whose counts each row holds (a row reused by a new state is rebuilt)."""

    def _allocate(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output is None or self.prompt is None or self.output.shape[1] != vocab:
            self.output = torch.zeros(self.rows, vocab, dtype=torch.int32, device=self.device)
            self.prompt = torch.zeros(self.rows, vocab, dtype=torch.bool, device=self.device)
            self._owners = [None] * self.rows
        return self.output, self.prompt

    def prepare(self, states: list[_RequestState], vocab: int) -> torch.Tensor:
        """The rows of `states` on the device `[len(states)]` int64, building the counts of
        any state seen here for the first time from its tokens (all on the host then: a
        state's first sampled step has no token in flight)."""
        output, prompt = self._allocate(vocab)
        owners = self._owners
        fresh = [s for s in states if owners[s.row] is not s]
        if fresh:
            self._build(fresh, output, prompt)
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        return to_device(rows, self.device)

    def _build(
        self, fresh: list[_RequestState], output: torch.Tensor, prompt: torch.Tensor
    ) -> None:
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        output_rows: list[int] = []
        output_ids: list[int] = []
        for state in fresh:
            tokens = state.token_ids
            split = len(tokens) - state.num_output_tokens
            if UNRESOLVED_TOKEN in tokens:
                raise RuntimeError(f"row {state.row}: counts built over an unresolved token")
            prompt_rows += [state.row] * split
            prompt_ids += tokens[:split]
            output_rows += [state.row] * (len(tokens) - split)
            output_ids += tokens[split:]
            self._owners[state.row] = state
        rows = to_device(np.array([s.row for s in fresh], np.int64), self.device)
        output.index_fill_(0, rows, 0)
        prompt.index_fill_(0, rows, False)
        if prompt_ids:
            flat = to_device(np.array([prompt_rows, prompt_ids], np.int64), self.device)
            marks = torch.ones(len(prompt_ids), dtype=torch.bool, device=self.device)
            prompt.index_put_((flat[0], flat[1]), marks)  # no host scalar: no blocking copy
        if output_ids:
            flat = to_device(np.array([output_rows, output_ids], np.int64), self.device)
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=self.device)
            output.index_put_((flat[0], flat[1]), ones, accumulate=True)

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per row (`rows` from `prepare`, `token_ids` `[len(rows)]`
        int64 on the device), without a host sync."""
        assert self.output is not None
        ones = torch.ones(rows.shape[0], dtype=torch.int32, device=self.device)
        self.output.index_put_((rows, token_ids), ones, accumulate=True)


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> device tensor without a blocking copy (pinned staging on CUDA)."""
    host = torch.from_numpy(values)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
