"""A tiny CPU host for tests of the memory pool under the host loop: the engine shape, the
pool's policy, and `build_host_memory` wired to an engine the way the agent wires it."""

from __future__ import annotations

import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.finetune.data import TokenizedExample
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.memory import MemoryManagerConfig, build_host_memory, engine_kv_layout
from gpu_runtime.memory.factory import HostMemory
from gpu_runtime.model import CausalLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
ENGINE = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=64)
POLICY = MemoryManagerConfig(
    reserve_low_pages=2,
    reserve_high_pages=6,
    max_step_pages=4,
    shrink_after_iterations=2,
    grow_hold_iterations=1,
)
SEQ = 12
"""Tokens per example of `tiny_trainer`'s job."""
POOL_BLOCKS = 48
"""Pool size of `tiny_host`, in KV blocks of the engine's layout."""


def block_bytes(model: CausalLM) -> int:
    """One KV block of `ENGINE`'s layout (fp32 on CPU), the CPU pool's page."""
    layout = engine_kv_layout(model.config, block_size=4, dtype="float32", page_bytes=1)
    return layout.block_bytes


def host_config() -> EngineConfig:
    return EngineConfig(num_kv_blocks=1, **ENGINE)  # type: ignore[arg-type]


def tiny_host(model: CausalLM, policy: MemoryManagerConfig = POLICY) -> tuple[HostMemory, Engine]:
    """A `POOL_BLOCKS`-page pool and an engine over it, attached and decode-ready (bind a
    loop with ``host.bind_loop``)."""
    host = build_host_memory(
        model, host_config(), pool_bytes=POOL_BLOCKS * block_bytes(model), config=policy
    )
    engine = Engine(model, host.engine_config, kv_storage_factory=host.storage_factory)
    host.attach(engine)
    host.decode_ready()
    return host, engine


def tiny_trainer(model: CausalLM, *, checkpointing: bool = False, epochs: int = 4) -> LoraTrainer:
    """A rank-4 LoRA job of four random `SEQ`-token examples, two per micro-batch."""
    gen = torch.Generator().manual_seed(5)
    examples = [
        TokenizedExample(tuple(ids), tuple(ids))
        for ids in torch.randint(1, 480, (4, SEQ), generator=gen).tolist()
    ]
    hparams = resolve_hyperparameters(
        n_train_examples=4,
        n_epochs=epochs,
        batch_size=2,
        lora=LoraSpec(rank=4, alpha=8),
        seed=0,
        activation_checkpointing=checkpointing,
    )
    return LoraTrainer(model, examples, hparams)
