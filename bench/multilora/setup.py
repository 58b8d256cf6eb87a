"""Setup of ``python -m bench.multilora``: the model (`build_model`: a preset or the tiny config,
seeded random weights), the target sets and LoRA decode variants it measures (`TARGETS`,
`MODES`), the random PEFT adapters written for them (`write_adapter`), and per target set the
`MultiLoraRuntime` with those adapters registered and the engine over random KV storage with its
CUDA graphs captured (`setup_targets`). Nothing here times anything but the graph capture."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpu_runtime.contract.hparams import LoraSpec
from gpu_runtime.engine import Engine, EngineConfig
from gpu_runtime.finetune.checkpoint import ADAPTER_WEIGHTS
from gpu_runtime.finetune.lora import PEFT_KEY_PREFIX, lora_config
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM, ModelConfig, build_random_model
from gpu_runtime.model.tiny import tiny_config

TARGETS = {"qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"), "all": ("all-linear",)}

MODES = ("shared+kernels", "shared", "separate")
"""LoRA decode variants: shrink in the base GEMM or apart; expand in RoPE/SwiGLU or apart."""


def build_model(name: str, device: torch.device) -> tuple[CausalLM, str]:
    """The model `name` (a preset, or "tiny": float32 on CPU) with seeded random weights, and
    its dtype's name (the result file's config records it)."""
    if name == "tiny":
        config = tiny_config("llama")
        dtype = "float32" if device.type == "cpu" else "bfloat16"
    else:
        config = ModelConfig.preset(name)
        dtype = "bfloat16"
    return build_random_model(config, seed=0, device=device, dtype=dtype), dtype


def write_adapter(directory: Path, config: ModelConfig, spec: LoraSpec, seed: int) -> None:
    """A PEFT adapter with random A (~ 1/sqrt(in)) and B (~ 0.02): a visible effect on logits."""
    from gpu_runtime.contract.footprint import projection_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for module in spec.target_modules:
            fan_in, fan_out = shapes[module]
            parent = "self_attn" if module in TARGETS["qkvo"] else "mlp"
            key = f"{PEFT_KEY_PREFIX}model.layers.{layer}.{parent}.{module}"
            a = torch.randn(spec.rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, spec.rank, generator=gen) * 0.02
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    lora_config(spec).save_pretrained(str(directory))
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def random_storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    return torch.empty(shape, dtype=dtype, device=device).normal_()


@dataclass(frozen=True)
class RunSizes:
    """The sizes every target set of a run is measured at."""

    batch: int
    """Decode rows a step (the one CUDA graph batch bucket)."""
    context: int
    """Tokens each row has cached before the first timed step (capped: `setup_targets`)."""
    adapters: int
    """Adapter slots, each holding a distinct adapter."""
    rank: int
    """LoRA rank of every adapter (and the slots' max rank)."""
    steps: int
    """Timed steps per measurement."""
    warmup: int
    """Untimed steps after the rows are injected."""


@dataclass
class TargetSetup:
    """One target set's engine, ready to time. The caller unpacks it and drops it, so that the
    engine is released (and the CUDA cache emptied) when the caller deletes its own name."""

    engine: Engine
    runtime: MultiLoraRuntime
    names: list[str]
    """The registered adapters, one per slot: `{targets}-{i}`."""
    context: int
    """The context used: the one asked for, capped by a small model's position limit."""
    share_gemms: bool
    captured: Any
    """What `Engine.capture_cuda_graphs` returned."""
    capture_s: float


def setup_targets(
    model: CausalLM,
    targets: str,
    sizes: RunSizes,
    *,
    device: torch.device,
    adapter_root: Path,
    mode: str,
) -> TargetSetup:
    """The runtime with `sizes.adapters` adapters of rank `sizes.rank` on `TARGETS[targets]`
    (written under `adapter_root` unless already there) and an engine of one batch bucket,
    `sizes.batch`, sized for `warmup + 2 * steps` more tokens per sequence than `context`, its
    graphs captured.
    `mode` (`MODES`): "shared": the slots' A rows sit below the fused weights (one GEMM per
    group for base output and shrink), "separate": a shrink GEMM of its own; "+kernels": the
    q|k|v and gate|up expand terms are added inside the RoPE / SwiGLU kernels."""
    batch, adapters, rank = sizes.batch, sizes.adapters, sizes.rank
    steps, warmup = sizes.steps, sizes.warmup
    share_gemms = mode.startswith("shared")
    spec = LoraSpec(rank=rank, alpha=2 * rank, dropout=0.0, target_modules=TARGETS[targets])
    # a small model's position limit caps the context (the rows report the one used)
    context = min(sizes.context, model.config.max_position_embeddings - warmup - 2 * steps - 48)
    names = [f"{targets}-{i}" for i in range(adapters)]
    for i, adapter_name in enumerate(names):
        if not (adapter_root / adapter_name).exists():
            write_adapter(adapter_root / adapter_name, model.config, spec, seed=i)
    per_seq = -(-(context + warmup + 2 * steps + 20) // 16)
    config = EngineConfig(
        num_kv_blocks=batch * per_seq * 2 + 16,
        block_size=16,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
        max_model_len=per_seq * 16 + 16,
        device=str(device),
        cuda_graph_batch_sizes=(batch,),
        static_decode_batches=True,  # on CPU too: the eager LoRA step runs over the buffers
        lora_expand_in_kernels=mode.endswith("+kernels"),
    )
    runtime = MultiLoraRuntime(
        model,
        max_tokens=config.max_num_batched_tokens,
        num_slots=adapters,
        max_rank=rank,
        target_modules=spec.target_modules,
        share_gemms=share_gemms,
    )
    for adapter_name in names:
        runtime.register(adapter_name, adapter_root / adapter_name)
    engine = Engine(model, config, kv_storage_factory=random_storage, lora=runtime)
    t0 = time.perf_counter()
    captured = engine.capture_cuda_graphs()
    capture_s = time.perf_counter() - t0
    return TargetSetup(engine, runtime, names, context, share_gemms, captured, capture_s)
