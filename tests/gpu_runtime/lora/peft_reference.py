"""PEFT adapters built by peft itself over the HF model of a tiny config, and HF + peft's greedy
tokens and logprobs for them: the reference the engine's adapter serving is compared against
(CPU, fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import CausalLM, build_random_model, save_model
from gpu_runtime.model.tiny import tiny_config

MAX_TOKENS = 6
SAMPLING = SamplingParams(
    max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=0
)


def base_model(architecture: str) -> CausalLM:
    return build_random_model(tiny_config(architecture), seed=11, dtype="float32")


def write_base(architecture: str, directory: Path) -> Path:
    save_model(base_model(architecture), directory)
    return directory


def hf_model(base_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def write_peft_adapter(
    base_dir: Path,
    directory: Path,
    seed: int,
    config_class: str = "LoraConfig",
    scale: float = 0.15,
    **options: Any,
) -> Path:
    """``get_peft_model`` over the HF base with ``options``, every adapter tensor set to seeded
    normal values times ``scale`` (B non-zero, so the adapter matters), then
    ``save_pretrained``."""
    import peft

    config = getattr(peft, config_class)(task_type="CAUSAL_LM", **options)
    model = peft.get_peft_model(hf_model(base_dir), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(str(directory))
    return directory


def edit_config(directory: Path, **fields: Any) -> None:
    path = directory / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw))


@torch.no_grad()
def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompt: list[int]
) -> tuple[list[int], list[float]]:
    """HF (+ ``PeftModel.from_pretrained`` of ``adapter_dir``) greedy tokens and their
    logprobs, by full forwards (no cache)."""
    from peft import PeftModel

    model = hf_model(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    ids = list(prompt)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(MAX_TOKENS):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def engine_with(
    architecture: str, adapters: dict[str, Path], num_slots: int = 4, max_rank: int = 16
) -> tuple[Engine, MultiLoraRuntime]:
    base = base_model(architecture)
    config = EngineConfig(
        num_kv_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        # the same prompts run again on one engine compare bit for bit: with the prefix cache the
        # repeat would start after the cached prefix (other chunk shapes, last-bit rounding)
        enable_prefix_caching=False,
    )
    runtime = MultiLoraRuntime(base, max_tokens=32, num_slots=num_slots, max_rank=max_rank)
    for name, directory in adapters.items():
        runtime.register(name, directory)
    return Engine(base, config, lora=runtime), runtime


def engine_greedy(
    engine: Engine, prompts: list[list[int]], names: list[str | None]
) -> list[tuple[list[int], list[float]]]:
    """All prompts in one batch (row i with adapter ``names[i]``): tokens and logprobs each."""
    ids = [
        engine.add_request(p, SAMPLING, lora_name=n) for p, n in zip(prompts, names, strict=True)
    ]
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
            if out.finished:
                tokens[out.request_id] = list(out.output_token_ids)
    return [(tokens[i], logprobs[i]) for i in ids]


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 480, (n,), generator=generator).tolist() for n in lengths]
