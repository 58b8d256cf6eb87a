"""What a finetune quantum reports, the loss-curve record, and the trainer's own RNG."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, for the loss curve and job events."""

    step: int
    """Optimizer steps done, this one included (1-based)."""
    loss: float
    learning_rate: float
    grad_norm: float
    tokens: int


class TrainerRng:
    """The trainer's own CPU and CUDA generator states, swapped in around a quantum."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        all_devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
        with torch.random.fork_rng(devices=all_devices):  # manual_seed seeds every device
            torch.manual_seed(seed)
            self.cpu_state = torch.get_rng_state()
            self.cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {"cpu": self.cpu_state, "cuda": self.cuda_state}

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        cpu = state["cpu"]
        assert cpu is not None
        self.cpu_state = cpu
        self.cuda_state = state["cuda"] if self.device.type == "cuda" else None
