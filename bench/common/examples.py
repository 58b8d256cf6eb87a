"""Synthetic finetune data for the benchmarks' LoRA jobs (speed does not depend on the tokens)."""

from __future__ import annotations

import random

from gpu_runtime.finetune.data import TokenizedExample


def synthetic_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[TokenizedExample]:
    """``n`` examples of exactly ``seq_len`` uniform random tokens, every token a target."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = tuple(rng.randrange(vocab) for _ in range(seq_len))
        out.append(TokenizedExample(ids, ids))
    return out
