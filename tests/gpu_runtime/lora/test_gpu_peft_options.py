"""CUDA-only: adapters with per-module ranks and scalings (rslora, rank and alpha patterns,
layer selection), built by peft, in the bf16 engine's fused LoRA decode graphs: each request's
sampled-token logprobs match HF + peft's (fp32) within bf16. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.lora.runtime import MultiLoraRuntime
from gpu_runtime.model import save_model
from tests.gpu_runtime.lora.peft_reference import hf_model, write_peft_adapter
from tests.gpu_runtime.small_model import small_cuda_model

pytestmark = pytest.mark.gpu

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPTIONS: dict[str, dict[str, Any]] = {
    "rslora-ranks": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=ALL, rank_pattern={"v_proj": 16}
    ),
    "layers-alphas": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj", "down_proj"],
        layers_to_transform=[1, 3],
        alpha_pattern={"down_proj": 32},
    ),
}


@torch.no_grad()
def test_peft_options_in_fused_decode_graphs(tmp_path: Path) -> None:
    from peft import PeftModel

    model = small_cuda_model("llama")
    save_model(model, tmp_path / "base")
    for i, (name, options) in enumerate(OPTIONS.items()):
        write_peft_adapter(tmp_path / "base", tmp_path / name, seed=30 + i, scale=0.05, **options)
    config = EngineConfig(
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=256,
        device="cuda",
    )
    runtime = MultiLoraRuntime(model, max_tokens=config.max_num_batched_tokens, num_slots=2)
    for name in OPTIONS:
        runtime.register(name, tmp_path / name)
    engine = Engine(model, config, lora=runtime)
    assert engine.runner.decode.fused_lora_decode
    engine.capture_cuda_graphs()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (9, 33, 60, 4)]
    names: list[str | None] = ["rslora-ranks", None, "layers-alphas", "rslora-ranks"]
    params = SamplingParams(
        max_tokens=12, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True
    )
    ids = [engine.add_request(p, params, lora_name=n) for p, n in zip(prompts, names, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.new_logprobs)
    assert engine.runner.decode.num_lora_graph_steps >= 8
    agree = total = 0
    for rid, prompt, lora_name in zip(ids, prompts, names, strict=True):
        reference = hf_model(tmp_path / "base").cuda()
        if lora_name is not None:
            reference = PeftModel.from_pretrained(reference, str(tmp_path / lora_name)).eval()
        full = torch.tensor([prompt + tokens[rid]], device="cuda")
        ref = reference(input_ids=full).logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
        theirs = ref.gather(-1, torch.tensor(tokens[rid], device="cuda")[:, None])[:, 0]
        ours = torch.tensor(logprobs[rid], device="cuda")
        assert torch.allclose(ours, theirs, atol=0.1), (lora_name, ours, theirs)
        agree += int((ref.argmax(-1).cpu() == torch.tensor(tokens[rid])).sum())
        total += len(tokens[rid])
    assert agree >= 0.9 * total
    assert runtime._attached == {}
