"""Types the model runner shares with its decode path and with callers: the per-request state,
a step's host results, and the BLAS-library context."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_runtime.engine.request import SamplingParams, TokenLogprob


@contextlib.contextmanager
def blas_library(name: str | None) -> Iterator[None]:
    """`torch.backends.cuda.preferred_blas_library(name)` inside the block (None: unchanged)."""
    if name is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


@contextlib.contextmanager
def sm_carveout(carveout: int | None) -> Iterator[None]:
    """Inside the block, cuBLAS plans its GEMMs for the device's SMs less `carveout` (torch's
    experimental SM carveout; None: all of them); the previous setting is restored after."""
    previous = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(carveout)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)


@contextlib.contextmanager
def gemm_sm_target(sm_count: int | None, device_sms: int) -> Iterator[None]:
    """Inside the block, cuBLAS GEMMs plan for `sm_count` SMs instead of the device's
    `device_sms`: cuBLASLt (`blas_library`) with an SM-count target (`sm_carveout`, the
    device's SMs less the target). None, or a count covering the device: unchanged.

    For graphs captured on a green-context partition (they keep the kernels chosen then); plain
    cuBLAS ignores the target (docs/decisions/0019-partition-gemm-sm-target.md)."""
    if sm_count is None or sm_count >= device_sms:
        yield
        return
    if sm_count < 1:
        raise ValueError(f"sm_count must be >= 1, got {sm_count}")
    with blas_library("cublaslt"), sm_carveout(device_sms - sm_count):
        yield


_PADDING_ID = "\x00padding"
"""Request id of a graph bucket's padding slots in `LoraRuntime.set_batch` (never attached)."""


@dataclass
class _RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_output_tokens: int
    row: int
    lora_name: str | None = None
    lora_slot: int = -1
    pending_step: int = -1
    """`StepHandle.step` of the launched step whose sampled token is this state's last
    (`UNRESOLVED_TOKEN` in `token_ids` until that step is resolved); -1: none."""
    pending_index: int = -1
    """Row of that token in the step's sampled-token tensor."""


@dataclass
class ModelRunnerOutput:
    """Host results of one step, for requests that were sampled."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    """Per request asking `prompt_logprobs`: `(position, logprob of the prompt token at
    position)` for the prompt tokens this step's chunk predicted (position >= 1)."""
    used_cuda_graph: bool = False
    batch_bucket: int = 0


PendingTokens = tuple[torch.Tensor, np.ndarray]
"""Decode inputs still on the device: the unresolved step's sampled tokens and, per row of the
new step, the index into them (-1: the row's token is on the host)."""

UNRESOLVED_TOKEN = -1
"""Stands for a sampled token still on the device (launched, not yet resolved)."""


@dataclass
class StepHandle:
    """A step `ModelRunner.launch` queued on the device; `ModelRunner.resolve` reads it back.

    Between the two, the step's sampled tokens live only on the device (`token_ids`); the
    states it sampled hold `UNRESOLVED_TOKEN` at `positions` and count the token already
    (`num_computed_tokens`, `num_output_tokens`), so the next step can be launched on them,
    its decode inputs gathered from `token_ids` on the device.
    """

    step: int
    result: ModelRunnerOutput
    sampled_ids: list[str] = field(default_factory=list)
    states: list[_RequestState] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    """Index of each sampled state's new token in its `token_ids`."""
    token_ids: torch.Tensor | None = None
    """Sampled tokens on the device, `[len(sampled_ids)]` int64."""
    token_host: torch.Tensor | None = None
    """Pinned host copy of `token_ids` (valid once `event` completed)."""
    logprob_copies: list[Any] = field(default_factory=list)
    """Host copies of logprobs, top ids, top logprobs (None where not asked)."""
    event: Any = None
    """CUDA event recorded after the copies back (None on CPU)."""
    deferred: tuple[torch.Tensor, list[str], list[_RequestState], Any] | None = None
    """A step launched with its sampling deferred (`ModelRunner.launch(defer_sampling=True)`):
    its logits, the ids and states to sample, and the stream it runs on, until
    `ModelRunner.sample_deferred` queues the sampling."""
    resolved: bool = False
    device_done: bool = False
    """The host has waited for `event` (resolved, or waited for after a discard)."""
