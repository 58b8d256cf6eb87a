"""A trainer's CUDA-graph bookkeeping on CPU, for tests that drive graphed quanta end to end.

A CUDA graph cannot be captured on CPU, so `CpuReplayGraphs` replaces only that step
(`MicroBatchGraphs._capture_graph`): the "graph" runs the captured micro-batch's forward and
backward eagerly from the same static buffers a real replay reads and writes (inputs,
denominator, loss output; the gradients add into the same `.grad` tensors), and its pool is
what `pool_bytes(key)` says that shape's graph needs. Everything else, the capture policy,
the pool groups, releases, replays and the trainer's reports (`graph_peak_bytes`), is the real
code. The GPU tests (`test_graphs_gpu.py`) check real captures against eager runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpu_runtime.finetune.graph_policy import CapturePolicy, GraphKey
from gpu_runtime.finetune.graphs import MicroBatchGraphs, unpack_inputs
from gpu_runtime.finetune.trainer import LoraTrainer


class _EagerReplay:
    """What a captured graph's replay computes, run eagerly from its static buffers."""

    def __init__(
        self,
        graphs: MicroBatchGraphs,
        key: GraphKey,
        buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        pool: Any,
    ) -> None:
        self.graphs = graphs
        self.key = key
        self.inputs, self.denominator, self.loss_out = buffers
        self._pool = pool if pool is not None else object()

    def replay(self) -> None:
        ids, positions, loss_positions, loss_targets = unpack_inputs(self.inputs, self.key)
        with self.graphs._eager_rng()():
            loss_sum = self.graphs._forward_backward()(
                ids, positions, loss_positions, loss_targets, self.denominator, self.key.recompute
            )
        self.loss_out.copy_(loss_sum.detach())

    def pool(self) -> Any:
        return self._pool


class CpuReplayGraphs(MicroBatchGraphs):
    """`MicroBatchGraphs` of `trainer` whose captures work on CPU (see the module doc)."""

    def __init__(self, trainer: LoraTrainer, pool_bytes: Callable[[GraphKey], int]) -> None:
        super().__init__(
            trainer.token_loss.forward_backward,
            trainer.params,
            trainer.rng,
            trainer.device,
            trainer._rng_swap,
            CapturePolicy(),
        )
        self.pool_bytes = pool_bytes

    def _capture_graph(
        self,
        key: GraphKey,
        pool: Any,
        inputs: torch.Tensor,
        denominator: torch.Tensor,
        loss_out: torch.Tensor,
    ) -> tuple[Any, int]:
        replay = _EagerReplay(self, key, (inputs, denominator, loss_out), pool)
        return replay, self.pool_bytes(key)


def with_cpu_graphs(trainer: LoraTrainer, pool_bytes: Callable[[GraphKey], int]) -> LoraTrainer:
    """`trainer` with `CpuReplayGraphs` (before its first quantum)."""
    trainer.graphs = CpuReplayGraphs(trainer, pool_bytes)
    return trainer
