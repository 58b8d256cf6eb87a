"""CUDA graphs of the decode step, one per (batch bucket, partition key).

The partition key lets a co-location scheduler capture the same bucket once per SM partition
(e.g. per green context): capture with that partition's stream current, replay on it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

GraphKey = tuple[int, Hashable]


@dataclass
class CapturedGraph:
    """A captured decode step and its static output tensor."""

    graph: torch.cuda.CUDAGraph
    output: torch.Tensor


class DecodeGraphs:
    """Captures and replays `forward(batch_size) -> Tensor` over fixed-shape buffers.

    `forward` must read its inputs from static buffers (sliced to batch_size) and allocate
    nothing that outlives the call except its output. All graphs share one memory pool.
    """

    def __init__(
        self, forward: Callable[[int], torch.Tensor], share_pool_with: DecodeGraphs | None = None
    ) -> None:
        """`share_pool_with`: another set whose memory pool these graphs use too (graphs that
        never run at the same time, e.g. the base and the LoRA decode step)."""
        self._forward = forward
        self._graphs: dict[GraphKey, CapturedGraph] = {}
        self._pool: Any = None
        self._pool_owner = share_pool_with

    def keys(self) -> list[GraphKey]:
        """Captured (batch_size, partition) keys."""
        return list(self._graphs)

    def has(self, batch_size: int, partition: Hashable = None) -> bool:
        """True when that bucket is captured for that partition."""
        return (batch_size, partition) in self._graphs

    @torch.no_grad()
    def capture(
        self,
        batch_size: int,
        partition: Hashable = None,
        stream: torch.cuda.Stream | None = None,
        warmup_iters: int = 2,
    ) -> None:
        """Warm up (compiles kernels) and capture `forward(batch_size)` on `stream`."""
        stream = stream or torch.cuda.Stream()
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(warmup_iters):
                self._forward(batch_size)
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None and self._pool_owner is not None:
            self._pool = self._pool_owner._pool
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            output = self._forward(batch_size)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[(batch_size, partition)] = CapturedGraph(graph, output)

    def replay(self, batch_size: int, partition: Hashable = None) -> torch.Tensor:
        """Replay on the current stream; returns the static output (valid until next replay)."""
        captured = self._graphs[(batch_size, partition)]
        captured.graph.replay()
        return captured.output
