"""Tensor parallelism: a rank's place in its engine group, its collectives, and its shards.

`TensorParallel` (`parallel.py`) is a rank of an engine group with its decode, finetune and
control communicators and the four collectives of the Megatron layout; `ShardShape`
(`shard.py`) is which slice of each HF-named tensor (base weights and LoRA factors) the rank
holds; `world.py` starts engine groups' process groups (NCCL on GPUs, gloo on CPU);
`control.py` carries rank 0's ordered messages to the other ranks (`DriverChannel`,
`FollowerChannel`, with a keep-alive for idle groups and `EngineGroupError`).

The decode engine's contract under tensor parallelism (`gpu_runtime.engine.engine_group`):
rank 0 alone schedules, applies stop rules, tokenizes, masks grammars and samples; every call
it makes on its model runner that changes runner or device state is broadcast over the control
group before it runs, and each follower makes the same call with the same arguments, in the
same order; the sampled token ids are broadcast from rank 0 over the decode group right after
sampling. So followers never diverge: they hold the same request states and tokens as rank 0,
and their collectives pair with rank 0's one for one.

Imports neither Django nor the model (the engine's parts live in `gpu_runtime.engine`).
"""

from gpu_runtime.distributed.control import DriverChannel, EngineGroupError, FollowerChannel
from gpu_runtime.distributed.parallel import SINGLE, TensorParallel
from gpu_runtime.distributed.shard import COLUMN_PARALLEL, ROW_PARALLEL, ShardShape

__all__ = [
    "COLUMN_PARALLEL",
    "ROW_PARALLEL",
    "SINGLE",
    "DriverChannel",
    "EngineGroupError",
    "FollowerChannel",
    "ShardShape",
    "TensorParallel",
]
