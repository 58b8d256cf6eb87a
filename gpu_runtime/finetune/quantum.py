"""What a finetune quantum reports, the loss-curve record, and the trainer's own RNG."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.finetune.batching import DataPosition


@dataclass(frozen=True)
class QuantumResult:
    """What one quantum did."""

    examples: int
    """Examples of the micro-batch this quantum completed (0 if it only advanced layers)."""
    tokens: int
    """Real (unpadded) tokens of the completed micro-batch (0 if none completed)."""
    padded_tokens: int
    """Tokens including right padding (what the GPU computed) of the completed micro-batch."""
    loss_tokens: int
    """Targets that entered the loss."""
    loss: float | None
    """Mean token cross-entropy of the completed micro-batch (None if none completed)."""
    optimizer_step: bool
    """Whether this quantum completed a batch and stepped the optimizer."""
    step: int
    """Optimizer steps done after this quantum."""
    batch_loss: float | None
    """Mean token loss of the whole batch, when this quantum stepped the optimizer."""
    learning_rate: float | None
    """Rate used by the optimizer step, when there was one."""
    grad_norm: float | None
    """Adapter gradient L2 norm before clipping, when there was an optimizer step."""
    wall_s: float
    """Seconds from start to the final sync."""
    peak_memory_bytes: int | None
    """Peak CUDA memory allocated during the quantum (whole process), None on CPU."""
    position: DataPosition
    """Data position after the quantum."""
    finished: bool
    """True once every epoch is consumed."""
    checkpoint: Path | None = None
    """The checkpoint this quantum wrote (every ``checkpoint_every_steps`` and at the end)."""
    layer_passes: int = 0
    """Decoder-layer passes (forward or backward) run, when quanta are cut by layers."""
    micro_batch_done: bool = True
    """False while a layer-sliced micro-batch is still in progress."""
    graph: str = "off"
    """How the micro-batch's forward and backward ran: "off" (CUDA graphs not in use), "replay",
    "capture" (captured by this quantum, then replayed) or "eager" (graphs in use but this
    quantum ran eagerly; ``graph_fallback`` says why)."""
    graph_fallback: str | None = None
    """Why a graph-using trainer's quantum ran eagerly (warm-up, layer slices, failed capture)."""
    launch_s: float | None = None
    """Host seconds spent issuing the forward and backward (the part a CUDA graph removes)."""
    host_s: float | None = None
    """Host seconds from the start to the quantum's host sync: its CPU (and GIL) work, which
    competes with the decode loop's, as opposed to waiting for the GPU."""
    gpu_ms: float | None = None
    """Milliseconds the quantum's work took on its stream (CUDA events; None on CPU or when
    the quantum ran synchronously): for a quantum launched without waiting
    (``LoraTrainer.start_quantum``) its real duration, whenever its result is read."""
    recompute: bool = False
    """Whether the completed micro-batch recomputed its activations in the backward."""


def peak_allocated(device: torch.device) -> int | None:
    """Peak CUDA memory allocated on ``device`` since the quantum reset the count (None on
    CPU: the allocator keeps no figure)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def no_training_result(
    *,
    step: int,
    position: DataPosition,
    finished: bool,
    wall_s: float,
    peak: int | None,
    **fields: Any,
) -> QuantumResult:
    """A quantum that trained no example (a layer slice short of its micro-batch's end, or a
    validation pass): no tokens, no loss, no optimizer step; `fields` as QuantumResult's."""
    return QuantumResult(
        examples=0,
        tokens=0,
        padded_tokens=0,
        loss_tokens=0,
        loss=None,
        optimizer_step=False,
        step=step,
        batch_loss=None,
        learning_rate=None,
        grad_norm=None,
        wall_s=wall_s,
        peak_memory_bytes=peak,
        position=position,
        finished=finished,
        **fields,
    )


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, for the loss curve and job events."""

    step: int
    """Optimizer steps done, this one included (1-based)."""
    loss: float
    learning_rate: float
    grad_norm: float
    tokens: int
    accuracy: float | None = None
    """Mean token accuracy of the batch (argmax hits / loss targets, in train mode, during the
    step's own forward); None in a history restored from a checkpoint that did not keep it."""


class TrainerRng:
    """The trainer's own CPU generator state and CUDA generator.

    The CPU state is copied in and out around a quantum; the CUDA generator's state object is
    swapped into the process's default CUDA generator (a pointer swap) for eager work, and CUDA
    graphs register it directly (see :mod:`gpu_runtime.finetune.graphs`). Seeded like
    ``torch.manual_seed(seed)`` seeds the process's generators.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.cpu_state = torch.Generator().manual_seed(seed).get_state()
        self.cuda_generator: torch.Generator | None = None
        if device.type == "cuda":
            self.cuda_generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def cuda_state(self) -> torch.Tensor | None:
        return None if self.cuda_generator is None else self.cuda_generator.get_state()

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {"cpu": self.cpu_state, "cuda": self.cuda_state}

    def renew_cuda_generator(self, state: torch.Tensor) -> None:
        """Replace the CUDA generator by a new one at ``state``.

        A CUDA graph capture that fails before its end leaves the generator state it registered
        marked as capturing; every later draw from it (an eager quantum's dropout) then raises
        "Offset increment outside graph capture encountered unexpectedly". A new generator
        object has a clean state; ``state`` (taken before the capture) keeps the stream exact.
        """
        generator = torch.Generator(device=self.device)
        generator.set_state(state)
        self.cuda_generator = generator

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        cpu = state["cpu"]
        assert cpu is not None
        self.cpu_state = cpu
        cuda = state["cuda"]
        if self.cuda_generator is not None and cuda is not None:
            self.cuda_generator.set_state(cuda)


@contextlib.contextmanager
def swapped_rng(rng: TrainerRng) -> Iterator[None]:
    """Run with the trainer's generators; keep what they drew; restore the process's.

    On an exception the trainer's states are left as they were before the block."""
    process_cpu = torch.get_rng_state()
    torch.set_rng_state(rng.cpu_state)
    cuda_default = process_cuda = cuda_before = None
    if rng.cuda_generator is not None:
        index = rng.device.index if rng.device.index is not None else torch.cuda.current_device()
        cuda_default = torch.cuda.default_generators[index]
        process_cuda = cuda_default.graphsafe_get_state()
        cuda_before = rng.cuda_generator.get_state()
        cuda_default.graphsafe_set_state(rng.cuda_generator)
    try:
        yield
        rng.cpu_state = torch.get_rng_state()
    except BaseException:
        if cuda_before is not None and rng.cuda_generator is not None:
            rng.cuda_generator.set_state(cuda_before)
        raise
    finally:
        torch.set_rng_state(process_cpu)
        if cuda_default is not None and process_cuda is not None:
            cuda_default.graphsafe_set_state(process_cuda)
