"""The logit processors of a sampling step: logit bias, min_tokens, penalties, min_p.

`LogitsPlan.build` runs on the host once per step, only when some row asks for one of them
(`SamplingParams.needs_logits_processing`; default requests never get here): it gathers the
rows' parameters into two flat host arrays (one float, one int), copied to the device in two
non-blocking copies; everything after that is batched tensor work over the rows concerned, no
loop per request. Semantics are vLLM's (v1 sampler):

- logit bias: `logits[t] += bias[t]`;
- min_tokens: while the output has fewer than `min_tokens` tokens, eos and `stop_token_ids` are
  set to -inf (eos also under `ignore_eos`, as vLLM masks every stop token);
- repetition penalty (tokens in the prompt or the output): positive logits divided by it,
  the others multiplied; then frequency (times the output count) and presence (output tokens)
  penalties subtracted;
- min_p, after temperature: tokens with `p < min_p * max p` are dropped (`Sampler`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gpu_runtime.engine.request import SamplingParams


@dataclass
class LogitsPlan:
    """One step's processors (host side) and, after `stage`, their device tensors."""

    floats: np.ndarray
    """presence, frequency, repetition (one per penalised row), log min_p (one per row, -inf:
    off), bias values."""
    ints: np.ndarray
    """penalised rows, bias rows, bias tokens, masked rows, masked tokens."""
    num_rows: int
    num_penalised: int
    num_bias: int
    num_masked: int
    uses_min_p: bool
    all_penalised: bool
    """Every row of the batch is penalised (no gather / scatter of the rows)."""
    device_floats: torch.Tensor | None = None
    device_ints: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_indices: list[int],
        eos_token_ids: tuple[int, ...],
    ) -> LogitsPlan:
        """The plan of a batch (`output_indices`: index of the token sampled per row)."""
        rows = len(params)
        penalised: list[int] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        log_min_p = [-math.inf] * rows
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        masked_rows: list[int] = []
        masked_tokens: list[int] = []
        for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
            if not p.needs_logits_processing:
                continue
            if p.needs_token_counts:
                penalised.append(row)
                presence.append(p.presence_penalty)
                frequency.append(p.frequency_penalty)
                repetition.append(p.repetition_penalty)
            if p.min_p > 0.0 and not p.greedy:
                log_min_p[row] = math.log(p.min_p)
            for token, bias in p.logit_bias:
                bias_rows.append(row)
                bias_tokens.append(token)
                bias_values.append(bias)
            if index < p.min_tokens:
                stops = set(p.stop_token_ids).union(eos_token_ids)
                masked_rows += [row] * len(stops)
                masked_tokens += sorted(stops)
        floats = np.array(presence + frequency + repetition + log_min_p + bias_values, np.float32)
        ints = np.array(penalised + bias_rows + bias_tokens + masked_rows + masked_tokens, np.int64)
        return cls(
            floats,
            ints,
            rows,
            len(penalised),
            len(bias_rows),
            len(masked_rows),
            any(v > -math.inf for v in log_min_p),
            len(penalised) == rows,
        )

    @property
    def penalised_rows(self) -> list[int]:
        """Batch rows with a presence, frequency or repetition penalty (host)."""
        return [int(r) for r in self.ints[: self.num_penalised]]

    def stage(self, device: torch.device) -> None:
        """Copy the plan's arrays to `device` (non-blocking from pinned memory on CUDA)."""
        self.device_floats = _staged(self.floats, device)
        self.device_ints = _staged(self.ints, device)

    def penalised_index(self) -> torch.Tensor:
        """Device `[num_penalised]` int64 batch rows with penalties."""
        assert self.device_ints is not None
        return self.device_ints[: self.num_penalised]

    def apply(
        self,
        logits: torch.Tensor,
        counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        fused: bool = False,
    ) -> torch.Tensor:
        """fp32 `[B, V]` logits with bias, min_tokens masks and penalties applied (a new
        tensor; `logits` is not written; returned as they are when only min_p is asked).
        `counts`: output counts `[R, V]` int32, prompt marks `[R, V]` bool and, per penalised
        row in `penalised_rows` order, its row in them `[P]` int64 (`TokenCounts`). `fused`:
        the penalties in one Triton pass (`penalty_kernels`, CUDA), else in torch."""
        assert self.device_floats is not None and self.device_ints is not None
        floats, ints, rows = self.device_floats, self.device_ints, self.num_rows
        p, b, m = self.num_penalised, self.num_bias, self.num_masked
        if not (p or b or m):
            return logits
        out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if b:
            bias = floats[3 * p + rows :]
            out.index_put_((ints[p : p + b], ints[p + b : p + 2 * b]), bias, accumulate=True)
        if m:
            start = p + 2 * b
            masked = (ints[start : start + m], ints[start + m : start + 2 * m])
            out.index_put_(masked, out.new_full((m,), float("-inf")))
        if p:
            if counts is None:
                raise ValueError(f"{p} penalised rows and no token counts")
            output_counts, prompt_mask, count_rows = counts
            index = ints[:p]
            penalties = (floats[:p], floats[p : 2 * p], floats[2 * p : 3 * p])
            if fused:
                from gpu_runtime.engine.penalty_kernels import apply_penalties_in_place

                apply_penalties_in_place(
                    out, index, count_rows, output_counts, prompt_mask, *penalties
                )
                return out
            part = out if self.all_penalised else out.index_select(0, index)
            part = apply_penalties(
                part, output_counts[count_rows], prompt_mask[count_rows], *penalties
            )
            if self.all_penalised:
                out = part
            else:
                out.index_copy_(0, index, part)
        return out

    def log_min_p(self) -> torch.Tensor:
        """Device `[B]` fp32 log(min_p) per row (-inf: off)."""
        assert self.device_floats is not None
        p = self.num_penalised
        return self.device_floats[3 * p : 3 * p + self.num_rows]


def _staged(values: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(values)
    if device.type != "cuda":
        return host
    if host.numel() == 0:
        return torch.empty(0, dtype=host.dtype, device=device)
    return host.pin_memory().to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on fp32 `[P, V]` logits (rows' output counts `[P, V]` int32, prompt
    mask `[P, V]` bool, penalties `[P]` fp32): repetition over prompt and output tokens, then
    frequency and presence over output tokens. The torch form (CPU, and the reference of
    `penalty_kernels.apply_penalties_in_place`)."""
    in_output = output_counts > 0
    seen = in_output | prompt_mask
    factor = torch.where(seen, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * in_output


def apply_min_p(scaled: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with `p < min_p * max p` from temperature-scaled logits `[B, V]`
    (`log_min_p` `[B]`, -inf: off): in log space, `scaled < max + log(min_p)`."""
    top = scaled.amax(dim=-1, keepdim=True)
    return scaled.masked_fill(scaled < top + log_min_p[:, None], float("-inf"))
