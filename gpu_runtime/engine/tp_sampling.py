"""Sampling in a tensor-parallel engine group: rank 0 samples, every rank uses its tokens.

Every rank holds the whole logits (`CausalLM.compute_logits` gathers them), but only rank 0
knows the grammar masks, seeds and generator state, so only rank 0 samples. `DriverSampler`
(rank 0) samples as `Sampler` does and broadcasts the token ids over the decode group right
after; `FollowerSampler` (the other ranks) receives them instead of sampling. The next step of
every rank (a step ahead's device-side inputs, the penalty counts) thus reads identical
tokens. Followers compute no logprobs. At size 1 the runner holds a plain `Sampler` and none
of this runs (`sampler_for`).
"""

from __future__ import annotations

import torch

from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.engine.sampler import RowCounts, Sampler, SamplerOutput, SamplingBatch


class DriverSampler(Sampler):
    """Rank 0's sampler: `Sampler.sample`, then its token ids broadcast to the group."""

    def __init__(self, parallel: TensorParallel, device: torch.device, seed: int = 0) -> None:
        super().__init__(device, seed)
        self.parallel = parallel

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch, counts: RowCounts | None = None
    ) -> SamplerOutput:
        output = super().sample(logits, batch, counts)
        output.token_ids = self.parallel.broadcast_from_driver_(output.token_ids.contiguous())
        return output


class FollowerSampler(Sampler):
    """A follower's sampler: rank 0's token ids, received over the decode group."""

    def __init__(self, parallel: TensorParallel, device: torch.device, seed: int = 0) -> None:
        super().__init__(device, seed)
        self.parallel = parallel

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch, counts: RowCounts | None = None
    ) -> SamplerOutput:
        rows = logits.shape[0]
        if rows != len(batch.params):
            raise ValueError(f"{rows} logit rows for {len(batch.params)} sampling rows")
        token_ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
        return SamplerOutput(token_ids=self.parallel.broadcast_from_driver_(token_ids))


def sampler_for(parallel: TensorParallel, device: torch.device, seed: int) -> Sampler:
    """The runner's sampler: a plain `Sampler` at size 1, else the rank's side."""
    if parallel.size == 1:
        return Sampler(device, seed)
    if parallel.is_driver:
        return DriverSampler(parallel, device, seed)
    return FollowerSampler(parallel, device, seed)
