"""The measured runs of ``bench/finetune/run.py``: one training row of our trainer (``run_ours``) or
of HF transformers + PEFT (``run_hf``, on ``hf_peft_model`` built over the serving model's
tensors), the multi-LoRA decode rows through ``bench/multilora/run.py``, and the memory counters a
row reads (``reset_peak`` before, ``peak`` after). The runs return raw step seconds (host time
after each step's sync) and losses; ``bench/finetune/run.py`` turns them into a row's figures."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from gpu_runtime.contract.hparams import LoraSpec, resolve_hyperparameters
from gpu_runtime.finetune.batching import epoch_order
from gpu_runtime.finetune.data import IGNORE_INDEX, TokenizedExample
from gpu_runtime.finetune.trainer import LoraTrainer
from gpu_runtime.model import CausalLM

GB = 1e9


def reset_peak(device: torch.device) -> int:
    """Clear the peak counter; returns bytes allocated now (the row's baseline)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def random_examples(vocab: int, count: int, seq: int, seed: int) -> list[TokenizedExample]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (count, seq), generator=generator).tolist()
    return [TokenizedExample(tuple(row), (IGNORE_INDEX, *row[1:])) for row in ids]


def hf_peft_model(serving: CausalLM, spec: LoraSpec, device: torch.device) -> Any:
    """`get_peft_model(LlamaForCausalLM)` whose base parameters are `serving`'s tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**serving.config.to_hf_config())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=serving.lm_head.weight.dtype)
    hf.load_state_dict(serving.state_dict(), assign=True, strict=False)
    hf.tie_weights()
    rotary = hf.model.rotary_emb
    with torch.device(device):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    hf.config.use_cache = False
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=int(spec.alpha),
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(hf, config).train()


def run_ours(
    serving: CausalLM,
    spec: LoraSpec,
    examples: list[TokenizedExample],
    micro: int,
    warmup: int,
    variant: str,
) -> tuple[list[float], list[float], dict[str, Any]]:
    """variant: "harli" (fused forward, CUDA graphs), "harli_eager" (the same, no graphs),
    "harli_peft_tree" (peft modules' own forward), "harli_sliced4" (quanta of 4 decoder-layer
    passes; one timed step = a whole micro-batch), "harli_ckpt" (activation checkpointing).
    Returns step times, losses and how the quanta ran (graph modes, host launch ms)."""
    hparams = resolve_hyperparameters(
        n_train_examples=len(examples),
        n_epochs=1,
        batch_size=micro,
        lora=spec,
        seed=0,
        activation_checkpointing=variant == "harli_ckpt",
    )
    trainer = LoraTrainer(
        serving,
        examples,
        hparams,
        fused_forward=variant != "harli_peft_tree",
        cuda_graphs=False if variant == "harli_eager" else None,
    )
    max_layers = 4 if variant == "harli_sliced4" else None
    times, losses, modes, launches, hosts = [], [], [], [], []
    while not trainer.finished:
        start = time.perf_counter()
        result = trainer.step_quantum(max_examples=micro, max_layers=max_layers)
        while not result.micro_batch_done:
            result = trainer.step_quantum(max_examples=micro, max_layers=max_layers)
        times.append(time.perf_counter() - start)
        assert result.loss is not None
        losses.append(result.loss)
        assert result.optimizer_step and result.examples == micro
        modes.append(result.graph)
        launches.append(result.launch_s)
        hosts.append(result.host_s)
    timed = [x for x in launches[warmup:] if x is not None]
    host = [x for x in hosts[warmup:] if x is not None]
    info: dict[str, Any] = {
        "graph_modes": modes,
        "launch_ms_p50": round(statistics.median(timed) * 1e3, 3) if timed else None,
        "host_ms_p50": round(statistics.median(host) * 1e3, 3) if host else None,
        "graph_fallback": None if trainer.graphs is None else trainer.graphs.disabled,
    }
    del trainer
    return times[warmup:], losses, info


def run_hf(
    model: Any,
    examples: list[TokenizedExample],
    micro: int,
    warmup: int,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    """Train the (reused) HF+PEFT model with a fresh AdamW, one step per micro-batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4, fused=device.type == "cuda")
    # the order our trainer draws (seed 0), so both see the same batches
    order = epoch_order([e.num_tokens for e in examples], micro, seed=0, epoch=0)
    ids = torch.tensor([examples[i].input_ids for i in order], dtype=torch.long)
    times, losses = [], []
    for start_row in range(0, len(examples), micro):
        batch = ids[start_row : start_row + micro].to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        times.append(time.perf_counter() - start)
    del optimizer, params
    return times[warmup:], losses


@torch.no_grad()
def multi_lora_decode(
    serving: CausalLM, batch: int, adapters: int, rank: int, iters: int, device: torch.device
) -> list[dict[str, Any]]:
    """`Engine.step()` TPOT at context 512 through `bench/multilora/run.py`: base-only rows, every
    row on one of `adapters` adapters, and mixed, for q/k/v/o and all-linear LoRA (CUDA graphs
    on CUDA). Each row keeps bench/multilora/run.py's keys plus `step_ms_p50` and `cuda_graph`."""
    from bench.multilora.run import run_multilora

    rows, checks = run_multilora(
        serving, batch=batch, context=512, adapters=adapters, rank=rank, steps=iters
    )
    out: list[dict[str, Any]] = []
    for row in rows:
        if row["system"] != "harli":
            out.append(row)  # the previous eager LoRA path, forward only
            continue
        is_base = row["mix"] == "base"
        out.append(
            row
            | {
                "system": "harli_base" if is_base else f"harli_multi_lora_{row['mix']}",
                "step_ms_p50": row["tpot_ms_p50"],
                "cuda_graph": device.type == "cuda" and (is_base or row["lora_graph_steps"] > 0),
                "check": None if is_base else checks[row["lora_targets"]],
            }
        )
    return out
