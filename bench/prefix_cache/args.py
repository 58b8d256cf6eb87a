"""The command line of ``python -m bench.prefix_cache`` (options, defaults and their meaning);
the description is the first line of `bench/prefix_cache/run.py`'s docstring."""

from __future__ import annotations

import argparse
import os

TINY = {
    "model": "tiny",
    "device": "cpu",
    "system_prompt": 48,
    "user_min": 4,
    "user_max": 12,
    "output_tokens": 3,
    "requests": 12,
    "burst_requests": 8,
    "rate": 200.0,
    "block_size": 8,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
}
"""What ``--tiny`` sets: the tiny model on CPU, a trace of a few short requests (smoke test)."""


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The options; ``--tiny`` overrides the sizes with `TINY`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="llama3-8b", help="preset name or 'tiny'")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--system-prompt", type=int, default=2048, help="shared prefix tokens")
    parser.add_argument("--user-min", type=int, default=64, help="shortest user part (tokens)")
    parser.add_argument("--user-max", type=int, default=256, help="longest user part (tokens)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens each generates")
    parser.add_argument("--requests", type=int, default=160, help="requests of the Poisson trace")
    parser.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    parser.add_argument(
        "--burst-requests", type=int, default=96, help="requests all arriving at once (req/s)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (sizes: args.TINY)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=None, help="default: provenance.commit_hash()")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    if not 0 < args.user_min <= args.user_max:
        parser.error(f"need 0 < --user-min ({args.user_min}) <= --user-max ({args.user_max})")
    if args.system_prompt < 1 or args.output_tokens < 1 or args.requests < 1 or args.rate <= 0:
        parser.error("--system-prompt, --output-tokens, --requests and --rate must be positive")
    return args
