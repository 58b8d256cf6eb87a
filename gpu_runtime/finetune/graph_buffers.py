"""The graphed micro-batch's interface and static buffers: the forward-backward a graph
captures (:data:`ForwardBackward`), a micro-batch's :class:`GraphKey` (:func:`graph_key`), its
inputs packed into one int64 vector for a single host-to-device copy (:func:`pack_inputs`) and
the views a capture reads from it (:func:`unpack_inputs`), a captured graph with the static
buffers it reads and writes, and how one micro-batch ran (:class:`GraphRun`).

Split out of :mod:`gpu_runtime.finetune.graphs` (which re-exports the public names); the capture,
replay and pool bookkeeping live there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_runtime.finetune.batching import MicroBatch
from gpu_runtime.finetune.data import IGNORE_INDEX
from gpu_runtime.finetune.graph_policy import GraphKey, loss_slots

ForwardBackward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "int | torch.Tensor", bool],
    torch.Tensor,
]
"""``(input_ids [B, S], positions [B, S], loss_positions [N], loss_targets [N], denominator,
recompute)`` -> summed loss (fp32 scalar), after running the backward of
``loss_sum / denominator`` (with activation recomputation when ``recompute``)."""


def graph_key(batch: MicroBatch, stream: int, recompute: bool = False) -> GraphKey:
    """The key of ``batch`` (already padded to its sequence bucket) on ``stream``."""
    rows, seq_len = (int(n) for n in batch.input_ids.shape)
    slots = loss_slots(rows, seq_len, int(batch.loss_positions.numel()))
    return GraphKey(rows, seq_len, slots, stream, recompute)


def pack_inputs(batch: MicroBatch, loss_slots: int) -> torch.Tensor:
    """One int64 vector ``[ids (B*S) | positions (B*S) | loss positions | loss targets]``, the loss
    parts padded to ``loss_slots`` with position 0 / the ignore target (one host-to-device copy)."""
    n = int(batch.loss_positions.numel())
    if n > loss_slots:
        raise ValueError(f"{n} loss positions do not fit {loss_slots} slots")
    pad = loss_slots - n
    return torch.cat(
        [
            batch.input_ids.reshape(-1),
            batch.positions.reshape(-1),
            batch.loss_positions,
            torch.zeros(pad, dtype=torch.long, device=batch.loss_positions.device),
            batch.loss_targets,
            torch.full((pad,), IGNORE_INDEX, dtype=torch.long, device=batch.loss_targets.device),
        ]
    )


def unpack_inputs(
    packed: torch.Tensor, key: GraphKey
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``(input_ids [B, S], positions [B, S], loss_positions [N], loss_targets [N])``."""
    cells = key.rows * key.seq_len
    shape = (key.rows, key.seq_len)
    return (
        packed[:cells].view(shape),
        packed[cells : 2 * cells].view(shape),
        packed[2 * cells : 2 * cells + key.loss_slots],
        packed[2 * cells + key.loss_slots :],
    )


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: torch.Tensor  # packed int64 inputs (outside the pool)
    denominator: torch.Tensor  # fp32 [] (outside the pool)
    loss_sum: torch.Tensor  # fp32 [] the replay writes (outside the pool)
    extra_bytes: int  # memory the captured work needs above what was allocated before it


@dataclass(frozen=True)
class GraphRun:
    """How one micro-batch's forward and backward ran."""

    loss_sum: torch.Tensor
    """Summed token loss (fp32 scalar on the device; not synced)."""
    mode: str
    """"replay", "capture" (captured now, then replayed) or "eager"."""
    fallback: str | None
    """Why it ran eagerly (None when a graph ran)."""
    extra_bytes: int | None
    """For graph runs: memory the graph's work needs above what was allocated at capture."""
