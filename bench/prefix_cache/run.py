"""Automatic prefix caching on a chat-like trace: TTFT p50/p99 and requests/s with
`EngineConfig.enable_prefix_caching` off and on, in the same run.

A Llama-3-8B-shaped model (seeded random bf16 weights) serves a seeded trace whose requests
share a 2,048-token system prompt followed by a 64-256-token user part each, generating 16
tokens (greedy, ignoring eos): Poisson arrivals (`--rate`), then a burst of requests all
arriving at once (the requests/s the engine sustains). Each setting gets its own engine (KV
storage of random values, decode CUDA graphs captured, warmed up on a prompt sharing nothing
with the trace), and replays the same trace in real time: a request is added once its arrival
time has passed, TTFT is the time from its arrival to the step that returned its first token,
requests/s is requests over the time from the first arrival to the last completion. With
caching on, the trace's first request computes the system prompt and later requests start
after its cached blocks (the burst, other user parts after the same system prompt, finds them
cached by the Poisson replay before it).

Check (reported, not asserted): the fraction of Poisson requests whose greedy tokens are equal
with caching off and on (bf16 kernels over a cached prefix vs one recomputed in other chunks
may round differently; on random weights the argmax is often a near-tie).

Run: `python -m bench.prefix_cache` (about 2 minutes on an H200); writes
`bench/results/prefix_cache-<gpu>-<date>.json` and prints the table last. `--tiny` is a CPU
smoke run (tiny model, a few short requests).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from bench.common.provenance import commit_hash, write_result
from bench.common.samples import sample_percentile
from bench.prefix_cache.args import parse_args
from bench.prefix_cache.trace import TracedRequest, build_trace
from gpu_runtime.engine import Engine, EngineConfig, SamplingParams
from gpu_runtime.model import CausalLM, ModelConfig, build_random_model
from gpu_runtime.model.tiny import tiny_config

TTFT_P50_RATIO_TARGET = 5.0
"""Issue 28: caching on must cut TTFT p50 at least this many times on this trace."""


def build_model(name: str, device: torch.device) -> tuple[CausalLM, str]:
    """The model `name` (a preset, or "tiny": float32 on CPU) with seeded random weights, and
    its dtype's name."""
    if name == "tiny":
        config = tiny_config("llama")
        dtype = "float32" if device.type == "cpu" else "bfloat16"
    else:
        config = ModelConfig.preset(name)
        dtype = "bfloat16"
    return build_random_model(config, seed=0, device=device, dtype=dtype), dtype


def random_storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    """KV storage of random values (never zeros)."""
    return torch.empty(shape, dtype=dtype, device=device).normal_()


def build_engine(model: CausalLM, args: Any, caching: bool) -> Engine:
    """An engine with room for `max_num_seqs` whole requests without sharing (the same for both
    settings), decode graphs captured on CUDA."""
    block = args.block_size
    max_len = args.system_prompt + args.user_max + args.output_tokens + block
    blocks = args.max_num_seqs * -(-max_len // block) + 16
    config = EngineConfig(
        num_kv_blocks=blocks,
        block_size=block,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
        device=str(model.lm_head.weight.device),
        enable_prefix_caching=caching,
    )
    engine = Engine(model, config, kv_storage_factory=random_storage)
    if config.is_cuda:
        engine.capture_cuda_graphs()
    return engine


def replay(engine: Engine, trace: list[TracedRequest], output_tokens: int) -> dict[str, Any]:
    """Run `trace` in real time; per request its TTFT and end-to-end ms and its outputs."""
    params = SamplingParams(
        max_tokens=output_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    first: dict[str, float] = {}
    done: dict[str, tuple[float, list[int], int]] = {}
    index, count = 0, len(trace)
    start = time.perf_counter()
    while index < count or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while index < count and trace[index].arrival_s <= now:
            engine.add_request(trace[index].prompt, params, request_id=f"t{index}")
            index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, trace[index].arrival_s - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = (now, list(out.output_token_ids), out.num_cached_tokens)
    ids = [f"t{i}" for i in range(count)]
    ttft = [(first[rid] - r.arrival_s) * 1e3 for rid, r in zip(ids, trace, strict=True)]
    e2e = [(done[rid][0] - r.arrival_s) * 1e3 for rid, r in zip(ids, trace, strict=True)]
    makespan = max(done[rid][0] for rid in ids) - trace[0].arrival_s
    return {
        "ttft_ms": ttft,
        "e2e_ms": e2e,
        "requests_per_s": count / makespan,
        "tokens": [done[rid][1] for rid in ids],
        "cached_tokens": sum(done[rid][2] for rid in ids),
        "prompt_tokens": sum(len(r.prompt) for r in trace),
    }


def warm_up(engine: Engine, args: Any) -> None:
    """Two requests of the trace's shape on a prompt sharing nothing with it (kernels, graphs,
    allocator), run to completion."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    length = args.system_prompt + args.user_max
    prompts = [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(2)]
    engine.generate(prompts, SamplingParams(max_tokens=args.output_tokens, ignore_eos=True))


def row(args: Any, trace: str, caching: bool, result: dict[str, Any]) -> dict[str, Any]:
    """One result row (bench/README.md: `prefix_cache`)."""
    ttft, e2e = result["ttft_ms"], result["e2e_ms"]
    return {
        "model": args.model,
        "trace": trace,
        "system": "harli",
        "prefix_caching": caching,
        "requests": len(ttft),
        "ttft_ms_p50": sample_percentile(ttft, 50),
        "ttft_ms_p99": sample_percentile(ttft, 99),
        "e2e_ms_p50": sample_percentile(e2e, 50),
        "requests_per_s": result["requests_per_s"],
        "prompt_tokens": result["prompt_tokens"],
        "cached_tokens": result["cached_tokens"],
        "cached_frac": result["cached_tokens"] / result["prompt_tokens"],
    }


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per trace: off / on for TTFT p50 and p99, on / off for requests/s."""
    out: dict[str, dict[str, float]] = {}
    for trace in dict.fromkeys(r["trace"] for r in rows):
        off, on = (
            next(r for r in rows if (r["trace"], r["prefix_caching"]) == (trace, c))
            for c in (False, True)
        )
        out[trace] = {
            "ttft_p50_off_over_on": off["ttft_ms_p50"] / on["ttft_ms_p50"],
            "ttft_p99_off_over_on": off["ttft_ms_p99"] / on["ttft_ms_p99"],
            "requests_per_s_on_over_off": on["requests_per_s"] / off["requests_per_s"],
        }
    return out


def print_table(rows: list[dict[str, Any]], ratio: dict[str, dict[str, float]]) -> None:
    print(f"{'trace':8} {'caching':8} {'ttft p50':>9} {'ttft p99':>9} {'req/s':>7} {'cached':>7}")
    for r in rows:
        print(
            f"{r['trace']:8} {'on' if r['prefix_caching'] else 'off':8} "
            f"{r['ttft_ms_p50']:9.1f} {r['ttft_ms_p99']:9.1f} {r['requests_per_s']:7.2f} "
            f"{r['cached_frac']:7.2f}"
        )
    for trace, values in ratio.items():
        p50, p99 = values["ttft_p50_off_over_on"], values["ttft_p99_off_over_on"]
        rps = values["requests_per_s_on_over_off"]
        print(f"{trace}: TTFT p50 {p50:.2f}x lower, p99 {p99:.2f}x, req/s {rps:.2f}x")


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    started = time.perf_counter()
    device = torch.device(args.device)
    model, dtype = build_model(args.model, device)
    vocab = model.config.vocab_size
    shape = dict(
        vocab_size=vocab,
        system_prompt=args.system_prompt,
        user_min=args.user_min,
        user_max=args.user_max,
        system_seed=args.seed,
    )
    poisson = build_trace(requests=args.requests, rate=args.rate, seed=args.seed, **shape)
    burst = build_trace(requests=args.burst_requests, rate=None, seed=args.seed + 7, **shape)
    rows: list[dict[str, Any]] = []
    tokens: dict[bool, list[list[int]]] = {}
    for caching in (False, True):
        engine = build_engine(model, args, caching)
        warm_up(engine, args)
        result = replay(engine, poisson, args.output_tokens)
        tokens[caching] = result["tokens"]
        rows.append(row(args, "poisson", caching, result))
        rows.append(row(args, "burst", caching, replay(engine, burst, args.output_tokens)))
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r["trace"] != "poisson", r["prefix_caching"]))
    ratio = ratios(rows)
    pairs = list(zip(tokens[False], tokens[True], strict=True))
    check = {
        "tokens_equal_frac": sum(a == b for a, b in pairs) / len(pairs),
        "first_token_equal_frac": sum(a[0] == b[0] for a, b in pairs) / len(pairs),
    }
    met = ratio["poisson"]["ttft_p50_off_over_on"] >= TTFT_P50_RATIO_TARGET
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    config = {key: value for key, value in vars(args).items() if key not in ("out", "commit")}
    path = write_result(
        "prefix_cache",
        args.out,
        gpu,
        torch.__version__,
        args.commit or commit_hash(),
        config=config | {"dtype": dtype},
        rows=rows,
        ratios=ratio,
        check=check,
        targets={"ttft_p50_ratio_min": TTFT_P50_RATIO_TARGET, "met": met},
        wall_s=time.perf_counter() - started,
    )
    print(f"\nwrote {path} in {time.perf_counter() - started:.1f} s")
    print(f"check: {check}")
    print_table(rows, ratio)
