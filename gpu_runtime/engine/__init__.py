"""Decode engine: block manager, scheduler, model runner, sampler, `Engine.step()`."""

from gpu_runtime.engine.block_manager import BlockManager, NoFreeBlocksError
from gpu_runtime.engine.config import EngineConfig, EngineConfigError
from gpu_runtime.engine.continuous_batching import ContinuousBatchingScheduler
from gpu_runtime.engine.engine import Engine, UnknownAdapterError
from gpu_runtime.engine.engine_group import EngineGroup, ModelSource, start_engine_group
from gpu_runtime.engine.kv_cache import KVStorageFactory, PagedKVCache, default_kv_storage
from gpu_runtime.engine.request import (
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    SamplingParamsError,
    TokenLogprob,
)
from gpu_runtime.engine.scheduler import (
    AdapterAdmissionError,
    Scheduler,
    SchedulerOutput,
    StepPreview,
)
from gpu_runtime.engine.step_types import StepAhead, StepTimes
from gpu_runtime.lora.protocol import LoraRuntime

__all__ = [
    "AdapterAdmissionError",
    "BlockManager",
    "ContinuousBatchingScheduler",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineGroup",
    "KVStorageFactory",
    "LoraRuntime",
    "ModelSource",
    "NoFreeBlocksError",
    "PagedKVCache",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SamplingParamsError",
    "Scheduler",
    "SchedulerOutput",
    "StepAhead",
    "StepPreview",
    "StepTimes",
    "TokenLogprob",
    "UnknownAdapterError",
    "default_kv_storage",
    "start_engine_group",
]
