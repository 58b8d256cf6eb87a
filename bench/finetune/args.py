"""The command line of ``bench/finetune/run.py`` (its options and defaults) and the rows a run's
options ask for, in the order a time-boxed run measures them."""

from __future__ import annotations

import argparse
import os

TARGETS = {"qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"), "all": ("all-linear",)}


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``python -m bench.finetune``'s options; ``description`` is the first paragraph of its
    docstring."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="llama3-8b", help="ModelConfig preset")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--targets", default="qkvo,all")
    parser.add_argument("--seq", default="512,2048")
    parser.add_argument("--micro", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=8192, help="skip seq*micro above")
    parser.add_argument("--systems", default="harli,hf_peft")
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="also ours without CUDA graphs (every shape), via the peft tree, layer-sliced and "
        "with activation checkpointing (seq 512, micro-batch 4)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--time-budget-s", type=float, default=150.0, help="skip rows after")
    parser.add_argument("--no-decode", action="store_true", help="skip the multi-LoRA decode part")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    return parser.parse_args(argv)


def plan_rows(args: argparse.Namespace) -> list[tuple[str, int, int, str]]:
    """(targets, seq, micro-batch, system) of every training row: the headline setting (q/k/v/o,
    seq 512, micro-batch 4) first, then the rest in option order, ablations last."""
    systems = args.systems.split(",")
    plan: list[tuple[str, int, int, str]] = []
    ablations: list[tuple[str, int, int, str]] = []
    for targets in args.targets.split(","):
        for seq in map(int, args.seq.split(",")):
            for micro in map(int, args.micro.split(",")):
                if seq * micro > args.max_tokens:
                    continue
                for system in systems:
                    plan.append((targets, seq, micro, system))
                if args.ablation and seq == 512 and micro == 4:
                    for variant in ("harli_peft_tree", "harli_sliced4", "harli_ckpt"):
                        ablations.append((targets, seq, micro, variant))
                if args.ablation and "harli" in systems and "harli_eager" not in systems:
                    ablations.append((targets, seq, micro, "harli_eager"))  # graphs' gain
    # the headline setting first, ablations last, so a time-boxed run keeps what matters
    plan.sort(key=lambda item: (item[0], item[1], item[2]) != ("qkvo", 512, 4))
    plan += ablations
    return plan
