"""Sharing one GPU between decode and finetune: green-context SM partitions or plain streams.

The engine loop holds one ``GpuSharing`` (built by ``create_sharing``) and, each iteration, calls
``partition(decode_sms) -> (decode_stream, finetune_stream)``. See README.md for measured costs and
how decode CUDA graphs must be captured per (batch bucket, partition).
"""

from gpu_runtime.sharing.base import GpuSharing
from gpu_runtime.sharing.green import GreenContextError, SmPartitioner
from gpu_runtime.sharing.partition import Partition, PartitionError, PartitionTable
from gpu_runtime.sharing.select import MechanismChoice, choose_mechanism, create_sharing
from gpu_runtime.sharing.streams import StreamSharing

__all__ = [
    "GpuSharing",
    "GreenContextError",
    "MechanismChoice",
    "Partition",
    "PartitionError",
    "PartitionTable",
    "SmPartitioner",
    "StreamSharing",
    "choose_mechanism",
    "create_sharing",
]
