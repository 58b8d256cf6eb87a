"""Where each rank of a tensor-parallel engine group gets its model shard, and its device.

`ModelSource` is pickled into every spawned follower (`engine_group.start_engine_group`);
`rank_device` maps rank 0's device to rank `r`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.distributed.parallel import TensorParallel
from gpu_runtime.model.llama import CausalLM
from gpu_runtime.model.loader import build_random_model, load_model


@dataclass(frozen=True)
class ModelSource:
    """Where every rank gets its shard: a HF directory (each rank reads its slices), or a
    config and seed of random weights (a rank's shard is the one-GPU model's slice)."""

    directory: str | None = None
    config: ModelConfig | None = None
    seed: int = 0
    dtype: str | None = None
    """Weight dtype name; None: the config's."""

    def __post_init__(self) -> None:
        if (self.directory is None) == (self.config is None):
            raise ValueError("a model source is a directory or a config, exactly one")

    def build(self, parallel: TensorParallel, device: str) -> CausalLM:
        """This rank's shard on `device`."""
        if self.directory is not None:
            return load_model(self.directory, device=device, dtype=self.dtype, parallel=parallel)
        assert self.config is not None
        model = build_random_model(
            self.config, seed=self.seed, device=device, dtype=self.dtype, parallel=parallel
        )
        return model.eval()


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device when rank 0's is `device` (`cpu`, `cuda`, `cuda:k`)."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"
