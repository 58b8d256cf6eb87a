"""CUDA-only: per-request LoRA in the bf16 engine with captured decode graphs. Each request's
sampled-token logprobs match a dense forward of its merged-weights model. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.finetune.adapter_store import HostAdapter
from gpu_runtime.finetune.checkpoint import save_adapter
from gpu_runtime.finetune.hparams import LoraSpec
from gpu_runtime.finetune.lora import adapter_parameters, build_training_model
from gpu_runtime.finetune.lora_serving import MultiLoraRuntime
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config

pytestmark = pytest.mark.gpu

CONFIG = tiny_config(
    "llama",
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1000,
)


def _model() -> CausalLM:
    return build_random_model(CONFIG, seed=4, device="cuda", dtype="bfloat16")


@torch.no_grad()
def _merged(adapter: HostAdapter) -> CausalLM:
    merged = _model()
    for (layer, module), (a, b) in adapter.weights.items():
        block = merged.model.layers[layer]
        parent = block.mlp if module.endswith(("gate_proj", "up_proj", "down_proj")) else None
        weight = getattr(parent or block.self_attn, module).weight
        delta = adapter.scaling * (b.float() @ a.float())
        weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
    return merged


def test_cuda_engine_serves_adapters_beside_graph_decode(tmp_path: Path) -> None:
    model = _model()
    specs = {"alpha": LoraSpec(rank=8, alpha=16), "beta": LoraSpec(rank=4, alpha=8)}
    for i, (name, spec) in enumerate(specs.items()):
        tree = build_training_model(model, spec, seed=i)
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for p in adapter_parameters(tree):
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 0.05)
        save_adapter(tree, spec, tmp_path / name)
    config = EngineConfig(
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=512,
        device="cuda",
    )
    runtime = MultiLoraRuntime(model, max_tokens=config.max_num_batched_tokens, num_slots=2)
    for name in specs:
        runtime.register(name, tmp_path / name)
    engine = Engine(model, config, lora=runtime)
    assert engine.capture_cuda_graphs() == [8, 4, 2, 1]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 40, 77, 23)]
    names: list[str | None] = [None, "alpha", "beta", "alpha"]
    params = SamplingParams(
        max_tokens=12, temperature=0.0, logprobs=1, detokenize=False, ignore_eos=True
    )
    ids = [engine.add_request(p, params, lora_name=n) for p, n in zip(prompts, names, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.new_logprobs)
    references = {n: _merged(HostAdapter.from_directory(n, tmp_path / n, CONFIG)) for n in specs}
    agree = total = 0
    for rid, prompt, lora_name in zip(ids, prompts, names, strict=True):
        reference = _model() if lora_name is None else references[lora_name]
        full = torch.tensor([prompt + tokens[rid]], device="cuda")
        positions = torch.arange(full.shape[1], device="cuda")[None]
        with torch.no_grad():
            logits = reference.compute_logits(reference(full, positions))
        ref = logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
        ours = torch.tensor(logprobs[rid], device="cuda")
        theirs = ref.gather(-1, torch.tensor(tokens[rid], device="cuda")[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=0.1), (lora_name, ours, theirs)
        agree += int((ref.argmax(-1).cpu() == torch.tensor(tokens[rid])).sum())
        total += len(tokens[rid])
    assert agree >= 0.9 * total
    assert runtime._attached == {}
    # base-only requests afterwards still take the fixed-shape (graph) decode path
    before = engine.runner.num_static_decode_steps
    engine.generate([prompts[0]], params)
    assert engine.runner.num_static_decode_steps > before
