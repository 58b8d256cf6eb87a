"""The host's one serving engine per base model: weights, KV cache and the LoRA runtime that
serves every finished adapter by name in the same batches as base-model requests.

`EngineSpec` loads a model directory and hands the model to `host_factory.build_serving_engine`,
which assembles the engine: with the unified memory pool (`gpu_runtime.memory`; by default on
CUDA, on request on CPU) the KV cache is a view of the pool's reserved range and finetune tensors
borrow the pages decode does not need; without it (CPU by default) the KV cache is a plain tensor
of `num_kv_blocks` blocks. On CUDA the host also has its GPU sharing (green-context SM splits, or
prioritised streams where the driver cannot split) and decode graphs captured once per split, so
the co-location loop can run decode on some SMs and finetune quanta on the rest.

At `tensor_parallel_size` T > 1 the engine is an engine group on devices 0..T-1 (CPU: T gloo
ranks, `tp_serving.build_group_engine`): the degree is checked against the model's shape at
build, the pool is off (`memory_pool=True` is refused; None means off), and the followers build
their jobs' trainers with `jobs` (a `tp_serving.FollowerJobBuilder`, required there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from gpu_runtime.agent.config import DEFAULT_DECODE_GROUPS
from gpu_runtime.agent.host_factory import ServingEngine, build_serving_engine
from gpu_runtime.agent.tp_serving import FollowerJobBuilder, build_group_engine
from gpu_runtime.contract.hparams import DEFAULT_LORA_MAX_RANK
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model.loader import load_config, load_model, load_tokenizer


@dataclass(frozen=True)
class EngineSpec:
    """How this host builds its engine for a model directory (also when it loads another base
    model). `config.max_model_len` is capped by the model's position embeddings."""

    config: EngineConfig
    """Engine settings; `max_model_len` is the cap the host asks for."""
    dtype: str | None = None
    """Weights dtype (None: the checkpoint's)."""
    lora_slots: int = 8
    """Adapters resident on the device at once (more are served, swapped in LRU order)."""
    lora_max_rank: int = DEFAULT_LORA_MAX_RANK
    """Largest adapter rank the slots hold; a request for a larger one is refused (HTTP 400)."""
    memory_pool: bool | None = None
    """Use the unified memory pool; None: on CUDA devices only."""
    pool_bytes: int | None = None
    """The pool's size (required on CPU; on CUDA None takes the free device memory less the
    room decode's own allocations need)."""
    decode_groups: tuple[int, ...] | None = DEFAULT_DECODE_GROUPS
    """CUDA: decode SM splits to create, in units of the SM granularity (8 on Hopper), beside
    the whole device; None creates every split (each with its own graphs)."""
    tensor_parallel_size: int = 1
    """Ranks of the engine group (1: one engine on `config.device`)."""
    jobs: FollowerJobBuilder | None = None
    """At `tensor_parallel_size` > 1: how each follower builds a placed job's trainer."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.memory_pool:
            raise ValueError(
                "the unified memory pool runs at tensor_parallel_size 1 only (KV grow/shrink "
                f"and finetune lending are not mirrored to the followers); got "
                f"tensor_parallel_size {self.tensor_parallel_size} with the pool on"
            )
        if self.tensor_parallel_size > 1 and self.jobs is None:
            raise ValueError("tensor_parallel_size > 1 needs jobs (the followers' job builder)")
        if self.lora_slots < 1 or self.lora_max_rank < 1:
            raise ValueError(
                f"lora_slots and lora_max_rank must be >= 1, got {self.lora_slots}, "
                f"{self.lora_max_rank}"
            )
        if self.uses_pool and not self.config.is_cuda and not self.pool_bytes:
            raise ValueError(f"a memory pool on {self.config.device} needs pool_bytes")

    @property
    def uses_pool(self) -> bool:
        if self.tensor_parallel_size > 1:
            return False
        return self.config.is_cuda if self.memory_pool is None else self.memory_pool

    def build(self, model_dir: Path) -> ServingEngine:
        """Load `model_dir` and return its engine, with a `MultiLoraRuntime` as `engine.lora`
        over the same model object (the finetune trees of this host share its weights too),
        and its pool when `uses_pool`; at `tensor_parallel_size` > 1 the engine group's rank 0
        (`TensorParallelError` when the model cannot be sharded at that degree)."""
        if self.tensor_parallel_size > 1:
            return self._build_group(model_dir)
        model = load_model(model_dir, device=self.config.device, dtype=self.dtype)
        config = replace(
            self.config,
            max_model_len=min(self.config.max_model_len, model.config.max_position_embeddings),
        )
        lora = MultiLoraRuntime(  # before the pool: its slots are decode's memory
            model,
            max_tokens=config.max_num_batched_tokens,
            num_slots=self.lora_slots,
            max_rank=self.lora_max_rank,
        )
        return build_serving_engine(
            model,
            config,
            memory_pool=self.uses_pool,
            tokenizer=load_tokenizer(model_dir),
            lora=lora,
            pool_bytes=self.pool_bytes,
            decode_groups=self.decode_groups,
        )

    def _build_group(self, model_dir: Path) -> ServingEngine:
        positions = load_config(model_dir).max_position_embeddings
        config = replace(self.config, max_model_len=min(self.config.max_model_len, positions))
        assert self.jobs is not None
        return build_group_engine(
            model_dir,
            config,
            self.tensor_parallel_size,
            dtype=self.dtype,
            lora_slots=self.lora_slots,
            lora_max_rank=self.lora_max_rank,
            decode_groups=self.decode_groups,
            jobs=self.jobs,
        )


def lora_runtime(engine: Engine) -> MultiLoraRuntime:
    """The engine's LoRA runtime (engines built by :class:`EngineSpec` always have one)."""
    lora = engine.lora
    if not isinstance(lora, MultiLoraRuntime):
        raise TypeError(f"the host engine needs a MultiLoraRuntime, got {type(lora).__name__}")
    return lora
