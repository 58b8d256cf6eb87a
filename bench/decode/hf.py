"""The references of ``bench/decode/run.py`` from HF transformers on the same weight tensors: the
correctness check of our CUDA-graph decode path against HF bf16 (`check_correctness`) and HF's
decode step timed eager or with a static cache + ``torch.compile`` (`time_hf`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.decode.engine import DEVICE
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.model import CausalLM, build_random_model
from gpu_runtime.model.tiny import tiny_config


def hf_model(model: CausalLM) -> torch.nn.Module:
    """A HF model whose parameters are `model`'s tensors (no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model.config.to_hf_config())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    hf.load_state_dict(model.state_dict(), assign=True, strict=False)
    hf.tie_weights()
    rotary = hf.model.rotary_emb
    with torch.device(DEVICE):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    return hf.eval()


@torch.no_grad()
def check_correctness() -> dict[str, Any]:
    """Our CUDA-graph decode path vs HF bf16 on a small model: logprobs of our greedy tokens."""
    results: dict[str, Any] = {}
    for arch in ("llama", "qwen2"):
        config = tiny_config(
            arch,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            vocab_size=4096,
        ).replace(dtype="bfloat16")
        model = build_random_model(config, seed=1, device=DEVICE)
        engine = Engine(
            model,
            EngineConfig(
                num_kv_blocks=128,
                max_num_seqs=8,
                max_model_len=512,
                max_num_batched_tokens=1024,
                device="cuda",
            ),
        )
        engine.capture_cuda_graphs()
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (7, 100, 300)]
        params = SamplingParams(
            max_tokens=16, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True
        )
        ids = [engine.add_request(p, params) for p in prompts]
        toks: dict[str, list[int]] = {i: [] for i in ids}
        lps: dict[str, list[float]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                toks[out.request_id] += out.new_token_ids
                lps[out.request_id] += [lp.logprob for lp in out.new_logprobs]
        hf = hf_model(model)
        max_diff, agree, total = 0.0, 0, 0
        for rid, prompt in zip(ids, prompts, strict=True):
            ref = hf(torch.tensor([prompt + toks[rid]], device=DEVICE)).logits.float()
            ref = ref.log_softmax(-1)[0, len(prompt) - 1 : -1]
            chosen = torch.tensor(toks[rid], device=DEVICE)
            theirs = ref.gather(-1, chosen[:, None])[:, 0]
            max_diff = max(
                max_diff, float((torch.tensor(lps[rid], device=DEVICE) - theirs).abs().max())
            )
            agree += int((ref.argmax(-1) == chosen).sum())
            total += len(chosen)
        results[arch] = {"max_logprob_abs_diff": max_diff, "greedy_argmax_agreement": agree / total}
        del engine, model, hf
        torch.cuda.empty_cache()
    return results


@torch.no_grad()
def time_hf(
    model: CausalLM, hf: torch.nn.Module, batch: int, context: int, steps: int, compiled: bool
) -> dict[str, Any]:
    """HF's decode of `batch` sequences after a `context`-token prefill (greedy argmax; eager
    with its dynamic cache, or `compiled`: static cache + ``torch.compile`` reduce-overhead):
    wall ms of each of `steps` steps after the warm-up ones, synchronized on both sides."""
    from transformers import StaticCache

    gen = torch.Generator().manual_seed(batch + context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).to(DEVICE)
    warmup = 3 if compiled else 2
    if compiled:
        cache = StaticCache(config=hf.config, max_cache_len=context + warmup + steps + 1)  # type: ignore[arg-type]
        forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        out = hf(
            ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(context, device=DEVICE),
            logits_to_keep=1,
        )
    else:  # the prefill keeps the last position's logits only (b=256: 33 GB otherwise)
        out = hf(ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        forward = hf.forward
    token = out.logits[:, -1:].argmax(-1)
    del out
    times = []
    for step in range(warmup + steps):
        position = torch.tensor([context + step], device=DEVICE)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if compiled:
            logits = forward(
                token, past_key_values=cache, use_cache=True, cache_position=position
            ).logits
        else:
            logits = forward(token, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1).clone()
        torch.cuda.synchronize()
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    del cache
    return {"step_ms": times, "mean_context": context + warmup + steps / 2}
