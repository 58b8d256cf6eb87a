"""Tensor parallelism: a rank's place in its engine group, its collectives, and its shards.

`TensorParallel` (`parallel.py`) is a rank of an engine group with its decode, finetune and
control communicators and the four collectives of the Megatron layout; `ShardShape`
(`shard.py`) is which slice of each HF-named tensor (base weights and LoRA factors) the rank
holds; `world.py` starts engine groups' process groups (NCCL on GPUs, gloo on CPU).
Imports neither Django nor the model.
"""

from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.distributed.shard import COLUMN_PARALLEL, ROW_PARALLEL, ShardShape

__all__ = ["COLUMN_PARALLEL", "ROW_PARALLEL", "SINGLE", "ShardShape", "TensorParallel"]
