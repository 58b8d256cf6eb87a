"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds,
logprobs.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p
exactly. A request with a seed gets its noise from a generator seeded with (seed, output
index), so its tokens do not depend on the batch it ran in or on preemptions. Work that no row
needs (sorting for top-k/top-p, log-softmax for logprobs) is skipped; whether it is needed is
known on the host from the parameters, so no device sync is involved.

On CUDA, a batch of at least `FUSED_MIN_ROWS` rows with no top-k/top-p and no logprobs
(temperature and greedy rows, seeded or not) takes the fused kernels
(`sampling_kernels.gumbel_argmax`, the vocabulary split over several programs per row): the
same distribution, noise drawn in the kernel from a per-row seed (a seeded request's from its
seed and output index; the others' from a per-step seed of the sampler's own host generator),
parameters staged through pinned buffers. Its noise differs from the torch path's, so a seeded
request's tokens on CUDA differ from those on CPU (each is deterministic).

Order of application (vLLM's): logprobs are taken from the raw logits; then logit bias and the
min_tokens masks, then repetition, frequency and presence penalties (`logits_processing`);
greedy rows take the argmax of those logits; sampled rows then divide by the temperature,
apply min_p, then top-k / top-p, then draw. With `fused` on CUDA the penalties take one
Triton pass (`penalty_kernels`) reading the counts in place. Rows with a penalty or logit bias
but no min_p, top-k, top-p or logprobs still take the fused kernel, over the processed fp32
logits. A batch where no row asks for a processor builds nothing for them
(`SamplingBatch.needs_processing`, one host check per row).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from gpu_runtime.engine.logits_processing import LogitsPlan, apply_min_p
from gpu_runtime.engine.request import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15

FUSED_MIN_ROWS = 1
"""Smallest batch sampled by the fused kernels: the vocabulary is split over several programs
per row, so every batch size takes them (docs/decisions/0008-one-pass-sampler.md)."""


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step (host side)."""

    params: list[SamplingParams]
    output_indices: list[int]
    """Index of the token being sampled in each request's output (seeds the per-request noise)."""

    @cached_property
    def _flags(self) -> tuple[bool, bool, int | None, bool]:
        """(all greedy, some row needs the sort, largest logprob count or None, some row needs
        a logit processor), one pass."""
        all_greedy, needs_sort, top, processing = True, False, -1, False
        for p in self.params:
            if p.temperature != 0.0:
                all_greedy = False
                if p.top_k > 0 or p.top_p < 1.0:
                    needs_sort = True
            if p.logprobs is not None and p.logprobs > top:
                top = p.logprobs
            if p.needs_logits_processing:
                processing = True
        return all_greedy, needs_sort, (top if top >= 0 else None), processing

    @property
    def all_greedy(self) -> bool:
        """Every row is greedy."""
        return self._flags[0]

    @property
    def needs_sort(self) -> bool:
        """Some sampled row uses top-k or top-p."""
        return self._flags[1]

    @property
    def max_num_logprobs(self) -> int | None:
        """Largest top-logprob count asked for, or None when no row wants logprobs."""
        return self._flags[2]

    @property
    def needs_processing(self) -> bool:
        """Some row has a penalty, logit bias, min_p or min_tokens."""
        return self._flags[3]

    @property
    def penalised_rows(self) -> list[int]:
        """Rows with a presence, frequency or repetition penalty (they need `RowCounts`)."""
        if not self.needs_processing:
            return []
        return [row for row, p in enumerate(self.params) if p.needs_token_counts]


RowCounts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Output counts `[R, V]` int32, prompt marks `[R, V]` bool, and the row in them of each
penalised row `[P]` int64, in `SamplingBatch.penalised_rows` order (`token_counts.TokenCounts`)."""


@dataclass
class SamplerOutput:
    """Device tensors; the runner copies them to the host in one sync."""

    token_ids: torch.Tensor
    """`[B]` int64 sampled tokens."""
    logprobs: torch.Tensor | None = None
    """`[B]` fp32 logprob of each sampled token (raw distribution), if any row asked."""
    top_token_ids: torch.Tensor | None = None
    """`[B, k]` int64 most likely tokens, k = largest count asked."""
    top_logprobs: torch.Tensor | None = None
    """`[B, k]` fp32 their logprobs."""


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf.

    logits `[B, V]` fp32; top_k `[B]` int64 (V means off); top_p `[B]` fp32 (1 means off).
    The most likely token is always kept.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before > top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Samples one token per row of a logits batch."""

    def __init__(
        self,
        device: torch.device,
        seed: int = 0,
        fused: bool | None = None,
        fused_min_rows: int = FUSED_MIN_ROWS,
    ) -> None:
        """`fused`: use the one-pass CUDA kernel where it applies (None: on CUDA) for batches
        of at least `fused_min_rows` rows."""
        self.device = device
        self.fused_min_rows = fused_min_rows
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.fused = device.type == "cuda" if fused is None else fused
        self._host_rng = random.Random(seed)
        self._staged_rows = 0
        self._host_parity = 0
        self.num_fused_samples = 0
        """Steps sampled by the fused kernel."""
        self.eos_token_ids: tuple[int, ...] = ()
        """The model's eos tokens, masked with `stop_token_ids` while a row's output is
        shorter than its `min_tokens` (the engine sets them)."""
        self.num_processed_samples = 0
        """Steps that applied logit processors (penalties, bias, min_p, min_tokens)."""

    def _stage_fused(self, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row inverse temperature (0: greedy) and Philox seed, on the device."""
        rows = len(batch.params)
        if rows > self._staged_rows:
            size = max(rows, 2 * self._staged_rows, 64)
            pin = self.device.type == "cuda"
            # two pinned sets used in turn: the next step may be staged before this step's
            # copies ran (the runner launches a step before reading the previous one back)
            self._host_sets = [
                (
                    torch.zeros(size, dtype=torch.float32, pin_memory=pin),
                    torch.zeros(size, dtype=torch.int64, pin_memory=pin),
                )
                for _ in range(2)
            ]
            self._inv_temp = torch.zeros(size, dtype=torch.float32, device=self.device)
            self._seeds = torch.zeros(size, dtype=torch.int64, device=self.device)
            self._staged_rows = size
        self._host_parity ^= 1
        self._inv_temp_host, self._seeds_host = self._host_sets[self._host_parity]
        step_seed = self._host_rng.getrandbits(62)
        inv_temp = np.fromiter(
            (0.0 if p.greedy else 1.0 / p.temperature for p in batch.params), np.float32, rows
        )
        seeds = np.fromiter(
            (
                (step_seed + row) % (1 << 63)
                if p.seed is None
                else (p.seed * _SEED_MIX + index) % (1 << 63)
                for row, (p, index) in enumerate(
                    zip(batch.params, batch.output_indices, strict=True)
                )
            ),
            np.int64,
            rows,
        )
        self._inv_temp_host.numpy()[:rows] = inv_temp
        self._seeds_host.numpy()[:rows] = seeds
        self._inv_temp[:rows].copy_(self._inv_temp_host[:rows], non_blocking=True)
        self._seeds[:rows].copy_(self._seeds_host[:rows], non_blocking=True)
        return self._inv_temp[:rows], self._seeds[:rows]

    def _to_device(self, values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor without a blocking copy (pinned staging on CUDA)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=self.device)
        staged = torch.tensor(values, dtype=dtype).pin_memory()
        return staged.to(self.device, non_blocking=True)

    def _noise(self, shape: tuple[int, int], batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device, dtype=torch.float32)
        noise.exponential_(generator=self.generator)
        for row, (params, index) in enumerate(zip(batch.params, batch.output_indices, strict=True)):
            if params.seed is not None:
                row_seed = (params.seed * _SEED_MIX + index) % (1 << 63)
                gen = torch.Generator(device=self.device).manual_seed(row_seed)
                noise[row].exponential_(generator=gen)
        return noise

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch, counts: RowCounts | None = None
    ) -> SamplerOutput:
        """logits `[B, V]` (any float dtype) -> sampled tokens and optional logprobs (of the
        raw logits). `counts`: needed when some row has a presence, frequency or repetition
        penalty. `logits` is never written."""
        rows = logits.shape[0]
        if rows != len(batch.params):
            raise ValueError(f"{rows} logit rows for {len(batch.params)} sampling rows")
        raw = logits
        plan: LogitsPlan | None = None
        if batch.needs_processing:
            plan = LogitsPlan.build(batch.params, batch.output_indices, self.eos_token_ids)
            if plan.num_penalised and counts is None:
                raise ValueError(f"{plan.num_penalised} penalised rows and no token counts")
            plan.stage(self.device)
            logits = plan.apply(logits, counts, fused=self.fused and logits.is_cuda)
            self.num_processed_samples += 1
        uses_min_p = plan is not None and plan.uses_min_p
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        elif (
            self.fused
            and rows >= self.fused_min_rows
            and not batch.needs_sort
            and not uses_min_p
            and batch.max_num_logprobs is None
        ):
            from gpu_runtime.engine.sampling_kernels import gumbel_argmax

            inv_temp, seeds = self._stage_fused(batch)
            self.num_fused_samples += 1
            return SamplerOutput(token_ids=gumbel_argmax(logits, inv_temp, seeds))
        else:
            temps = [p.temperature if not p.greedy else 1.0 for p in batch.params]
            temperature = self._to_device(temps, torch.float32)
            scaled = logits.float() / temperature[:, None]
            if uses_min_p:
                assert plan is not None
                scaled = apply_min_p(scaled, plan.log_min_p())
            if batch.needs_sort:
                vocab = logits.shape[-1]
                top_k = self._to_device(
                    [p.top_k if p.top_k > 0 else vocab for p in batch.params], torch.int64
                )
                top_p = self._to_device([p.top_p for p in batch.params], torch.float32)
                scaled = apply_top_k_top_p(scaled, top_k, top_p)
            # argmax(p / E) == argmax(log p - log E); log p = scaled - logsumexp(row), so the
            # softmax is not needed.
            noise = self._noise((rows, logits.shape[-1]), batch)
            sampled = (scaled - noise.log_()).argmax(dim=-1)
            greedy_rows = [p.greedy for p in batch.params]
            if any(greedy_rows):
                is_greedy = self._to_device([int(g) for g in greedy_rows], torch.int64) > 0
                sampled = torch.where(is_greedy, logits.argmax(dim=-1), sampled)
            token_ids = sampled
        output = SamplerOutput(token_ids=token_ids)
        top = batch.max_num_logprobs
        if top is not None:
            logprobs = raw.float().log_softmax(dim=-1)
            output.logprobs = logprobs.gather(-1, token_ids[:, None])[:, 0]
            if top > 0:
                values, indices = logprobs.topk(top, dim=-1)
                output.top_token_ids = indices
                output.top_logprobs = values
        return output
