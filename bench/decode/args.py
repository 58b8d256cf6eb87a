"""The command line of ``bench/decode/run.py`` (its options, defaults and their meaning)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

VARIANTS = ("sync", "async", "pdl-all", "no-pdl")
"""Engine variants `--variants` knows: the scheduling mode (sync / async; every other variant is
async), programmatic dependent launch at every batch (pdl-all) or none (no-pdl) instead of the
engine's `decode_programmatic_launch_rows`."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``bench/decode/run.py``'s options (the module docstring there says what a run does)."""
    parser = argparse.ArgumentParser(
        description="Decode speed on one GPU: our engine vs HF transformers (eager; static cache "
        "+ torch.compile)"
    )
    parser.add_argument("--models", default="llama3-8b,qwen2.5-7b")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--hf-eager",
        default="1,8,32,64,128,256",
        help="batches for HF eager (at --hf-context; its prefill keeps only the last logits)",
    )
    parser.add_argument("--hf-compile", default="1,64", help="batches for HF compile (ctx 512)")
    parser.add_argument("--hf-compile-models", default="llama3-8b,qwen2.5-7b")
    parser.add_argument("--hf-context", type=int, default=512)
    parser.add_argument("--hf-steps", type=int, default=10)
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="skip HF compile rows past this wall time"
    )
    parser.add_argument("--no-fused", action="store_true", help="plain model forward in graphs")
    parser.add_argument(
        "--prefill-chunks",
        default="256,512,1024,2048",
        help="chunk sizes for a 2048-token prompt beside 32 decode rows (first model only)",
    )
    parser.add_argument(
        "--extras",
        default="",
        help="comma list: gemm (cuBLAS vs cuBLASLt over the decode GEMMs), sampler (paths), "
        "mixed (host profile of steps carrying a prefill chunk)",
    )
    parser.add_argument("--skip-check", action="store_true", help="no correctness check")
    parser.add_argument(
        "--mixed-graphs",
        action="store_true",
        help="EngineConfig.mixed_cuda_graphs (steps with prefill chunks from piecewise graphs; "
        "the prefill studies then run with and without them)",
    )
    parser.add_argument(
        "--blas",
        default=None,
        choices=["cublas", "cublaslt"],
        help="EngineConfig.decode_blas_library",
    )
    parser.add_argument(
        "--variants",
        default="async,sync",
        help="engine variants timed per (batch, context), the first as system 'harli', the "
        "others as 'harli_<variant>': sync, async (EngineConfig.async_scheduling), pdl-all / "
        "no-pdl (async with programmatic dependent launch at every batch / none, instead of "
        "EngineConfig.decode_programmatic_launch_rows); variants other than sync and async "
        "re-capture the decode graphs",
    )
    parser.add_argument("--quick", action="store_true", help="smoke: llama, batch 8/64, ctx 512")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="kernel-time breakdown of decode steps and an attention sweep",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    args = parser.parse_args(argv)
    unknown = [v for v in _names(args.variants) if v not in VARIANTS]
    if unknown or not _names(args.variants):
        parser.error(
            f"--variants {args.variants!r}: unknown {unknown}; known: {', '.join(VARIANTS)}"
        )
    return args


def apply_quick(args: argparse.Namespace) -> None:
    """``--quick``: a smoke run (Llama-3-8B, batches 8 and 64, context 512, HF eager at 64)."""
    args.models, args.batches, args.contexts = "llama3-8b", "8,64", "512"
    args.hf_eager, args.hf_compile, args.steps = "64", "", 20


@dataclass(frozen=True)
class Sweep:
    """What one run times, parsed from the options (after ``--quick``)."""

    models: list[str]  # presets, in order; the studies run on the first
    batches: list[int]
    contexts: list[int]
    hf_eager: list[int]  # batches of HF eager, at --hf-context
    hf_compile: list[int]  # batches of HF static cache + torch.compile, at --hf-context
    chunks: list[int]  # --prefill-chunks: chunk sizes of the prefill study
    extras: list[str]  # --extras studies
    variants: list[str]  # engine variants; the first is system "harli"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Sweep:
        return cls(
            models=_names(args.models),
            batches=_ints(args.batches),
            contexts=_ints(args.contexts),
            hf_eager=_ints(args.hf_eager),
            hf_compile=_ints(args.hf_compile),
            chunks=_ints(args.prefill_chunks),
            extras=_names(args.extras),
            variants=_names(args.variants),
        )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]
