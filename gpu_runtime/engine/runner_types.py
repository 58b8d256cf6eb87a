"""Types the model runner shares with its decode path and with callers: the per-request state,
a step's host results, and the BLAS-library context."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

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


@dataclass
class ModelRunnerOutput:
    """Host results of one step, for requests that were sampled."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    used_cuda_graph: bool = False
    batch_bucket: int = 0
