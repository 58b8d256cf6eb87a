"""Paged attention backends: torch gather + SDPA (any device) and a Triton decode kernel."""

from gpu_runtime.engine.attention.metadata import AttentionMetadata
from gpu_runtime.engine.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionMetadata", "TorchPagedAttention"]
