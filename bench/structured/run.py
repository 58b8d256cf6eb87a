"""Structured output's cost in decode: `Engine.step()` TPOT of a batch of 64 at context ~512 with
32 rows constrained by a JSON schema, against the same batch with none, on a Llama-3-8B-shaped
model (seeded random bf16 weights), CUDA graphs and async scheduling on (as the server runs).

The tokenizer is `tokenizer.synthetic_tokenizer`: a byte-level BPE of Llama-3's 128,256 tokens
built without downloads (the grammar's costs depend on the vocabulary, not on the weights). The
schema asks for an object holding at least 64 strings, so no constrained row can end inside
the timed steps; random weights sample garbage, but every constrained row's tokens are checked
against a fresh matcher of the schema after timing. Rows: ``unconstrained`` (async, the
baseline), ``structured`` (32 of 64 rows constrained: the engine masks their logits; each step
ahead runs its model early and samples once the matchers hold the previous step's tokens) and
``unconstrained_sync`` (async off: what losing the step ahead would cost). Beside them, the
grammar's compile time and the two per-step costs apart (the host's bitmask fill for 32 rows,
the masking on the device).

Run: `python -m bench.structured` (under 4 minutes on an H200); `--tiny` is a CPU smoke run
(the tiny model and tokenizer, batch 4 with 2 rows constrained; no figure worth quoting).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from bench.common.provenance import commit_hash, write_result
from bench.structured.measure import SCHEMA, build_engine, compile_costs, mask_costs, time_decode
from bench.structured.tokenizer import synthetic_tokenizer
from gpu_runtime.model import ModelConfig, build_random_model
from gpu_runtime.structured import StructuredOutputParams

TPOT_RATIO_TARGET = 1.10
"""Issue 28: structured TPOT over unconstrained TPOT, at most."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny model")
    parser.add_argument("--batch", type=int, default=None, help="rows (64; --tiny: 4)")
    parser.add_argument("--constrained", type=int, default=None, help="of them (32; --tiny: 2)")
    parser.add_argument("--context", type=int, default=None, help="tokens (512; --tiny: 16)")
    parser.add_argument("--steps", type=int, default=None, help="timed (200; --tiny: 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed (20; --tiny: 1)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)
    small, full = (4, 2, 16, 4, 1), (64, 32, 512, 200, 20)
    defaults = small if args.tiny else full
    for name, value in zip(
        ("batch", "constrained", "context", "steps", "warmup"), defaults, strict=True
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 0 < args.constrained <= args.batch:
        parser.error(f"--constrained={args.constrained} must be in [1, --batch={args.batch}]")
    return args


def _model_and_tokenizer(tiny: bool) -> tuple[Any, Any, str]:
    if tiny:
        import tempfile

        from transformers import AutoTokenizer

        from gpu_runtime.contract.tiny_tokenizer import build_tiny_tokenizer
        from gpu_runtime.model.tiny import tiny_config

        with tempfile.TemporaryDirectory() as tmp:
            build_tiny_tokenizer(tmp)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
        model = build_random_model(tiny_config("llama"), seed=0, device="cpu", dtype="float32")
        return model, tokenizer, "tiny"
    config = ModelConfig.preset("llama3-8b")
    model = build_random_model(config, seed=0, device="cuda", dtype="bfloat16")
    return model, synthetic_tokenizer(config.vocab_size), "llama3-8b"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    model, tokenizer, model_name = _model_and_tokenizer(args.tiny)
    device = model.lm_head.weight.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    structured = StructuredOutputParams.json_schema(SCHEMA)
    vocab = model.config.vocab_size
    costs = compile_costs(tokenizer, vocab, structured)
    engine = build_engine(model, tokenizer, args.batch, args.context, args.warmup + args.steps + 8)
    shape = dict(batch=args.batch, context=args.context, warmup=args.warmup, steps=args.steps)
    rows: list[dict[str, Any]] = []
    for system, constrained, use_async in (
        ("unconstrained", 0, True),
        ("structured", args.constrained, True),
        ("unconstrained_sync", 0, False),
        ("structured_again", args.constrained, True),
        ("unconstrained_again", 0, True),
    ):
        timed = time_decode(
            engine,
            constrained=constrained,
            structured=structured,
            async_scheduling=use_async,
            **shape,
        )
        rows.append(
            {"model": model_name, "system": system, **shape, "constrained_rows": constrained}
            | timed
        )
    costs["mask"] = mask_costs(engine, structured, args.constrained, args.batch, args.steps)
    by = {r["system"]: r for r in rows}
    # A/B/A/B order: each side's figure is the mean of its two runs' p50 (drift cancels)
    base = (by["unconstrained"]["tpot_ms_p50"] + by["unconstrained_again"]["tpot_ms_p50"]) / 2
    bound = (by["structured"]["tpot_ms_p50"] + by["structured_again"]["tpot_ms_p50"]) / 2
    base99 = (by["unconstrained"]["tpot_ms_p99"] + by["unconstrained_again"]["tpot_ms_p99"]) / 2
    bound99 = (by["structured"]["tpot_ms_p99"] + by["structured_again"]["tpot_ms_p99"]) / 2
    comparison = {
        "tpot_ratio_p50": round(bound / base, 4),
        "tpot_ratio_p99": round(bound99 / base99, 4),
        "sync_over_async_p50": round(by["unconstrained_sync"]["tpot_ms_p50"] / base, 4),
        "target_ratio": TPOT_RATIO_TARGET,
        "met": bound / base <= TPOT_RATIO_TARGET,
    }
    config = {
        "model": model_name,
        **shape,
        "constrained_rows": args.constrained,
        "schema": SCHEMA,
        "temperature": 0.8,
        "tokenizer": "tiny" if args.tiny else "synthetic byte-level BPE, 128256 tokens, seed 0",
        "async_scheduling": True,
    }
    out = write_result(
        "structured",
        args.out,
        gpu,
        torch.__version__,
        commit_hash(),
        config=config,
        rows=rows,
        comparison=comparison,
        costs=costs,
        wall_s=round(time.perf_counter() - started, 1),
    )
    print(f"\nwrote {out} in {time.perf_counter() - started:.1f} s")
    print(f"{'system':<22}{'constrained':>12}{'p50 ms':>10}{'p99 ms':>10}{'ahead':>7}")
    for r in rows:
        print(
            f"{r['system']:<22}{r['constrained_rows']:>12}{r['tpot_ms_p50']:>10.3f}"
            f"{r['tpot_ms_p99']:>10.3f}{r['overlapped_steps']:>7}"
        )
    mask = costs["mask"]
    print(
        f"ratio p50 {comparison['tpot_ratio_p50']:.4f} p99 {comparison['tpot_ratio_p99']:.4f}"
        f" (target <= {TPOT_RATIO_TARGET}); compile {costs['compile_ms']:.1f} ms;"
        f" fill {mask['fill_ms_p50']:.3f} ms, mask {mask['apply_ms_p50']:.3f} ms"
        f" for {mask['rows']} rows"
    )
