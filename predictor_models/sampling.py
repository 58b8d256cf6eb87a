"""Random configurations the profiler measures: decode batches, prompt chunks, finetune quanta.

``sample_step`` draws one engine step within a deployment's limits (``StepSpace``): batch size
log-uniform in 1..``max_batch``, mean context log-uniform in ``context_range`` with +-50% per
sequence (each capped below ``max_model_len``), and, with probability ``chunk_share``, prompt
chunks whose total size is log-uniform in ``chunk_min``..(token budget - batch), so every token
bucket of the engine's mixed-step graphs gets rows; decode rows and prompts together are at
most ``max_batch`` sequences, as in the engine's scheduler. A chunk may follow a prefix of its
prompt already in the KV cache (``prefix_share``) and a step may carry two chunks
(``two_chunk_share``), as steps of a serving engine with chunked prefill do; the profile records
both (the predictor's features see only the chunk tokens).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Chunks = list[tuple[int, int]]
"""``(prefix tokens already cached, chunk tokens)`` per prompt chunk of a step."""


@dataclass(frozen=True)
class StepSpace:
    """Limits of the steps ``sample_step`` draws (see the module docstring)."""

    max_batch: int = 256
    context_range: tuple[float, float] = (32.0, 4096.0)
    max_model_len: int = 8192
    token_budget: int = 8192
    """Decode rows + chunk tokens of one step (the engine's ``max_num_batched_tokens``)."""
    chunk_share: float = 0.0
    chunk_min: int = 16
    prefix_share: float = 0.0
    prefix_max: int = 1024
    two_chunk_share: float = 0.0

    def __post_init__(self) -> None:
        lo, hi = self.context_range
        if not 1 <= lo <= hi or self.max_batch < 1 or self.chunk_min < 1:
            raise ValueError(f"invalid step space {self}")
        for name in ("chunk_share", "prefix_share", "two_chunk_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.token_budget < self.max_batch + self.chunk_min and self.chunk_share:
            raise ValueError(
                f"token_budget {self.token_budget} leaves no chunk beside {self.max_batch} rows"
            )


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def sample_contexts(rng: random.Random, max_kv_tokens: int, space: StepSpace) -> list[int]:
    """Per-sequence contexts of one decode batch that fits ``max_kv_tokens``."""
    cap = space.max_model_len - 2  # the new token's position + 1 <= max_model_len
    while True:
        batch = max(1, round(_log_uniform(rng, 1.0, float(space.max_batch))))
        mean = _log_uniform(rng, *space.context_range)
        contexts = [min(cap, max(1, round(mean * rng.uniform(0.5, 1.5)))) for _ in range(batch)]
        if batch * (max(contexts) + 1) <= max_kv_tokens:
            return contexts


def sample_chunks(rng: random.Random, batch: int, space: StepSpace) -> Chunks:
    """Prompt chunks of one step beside ``batch`` decode rows (empty: a decode-only step)."""
    room = min(space.token_budget - batch, space.max_model_len)
    seats = space.max_batch - batch  # a prompt being prefilled is one of the step's sequences
    if rng.random() >= space.chunk_share or room < space.chunk_min or seats < 1:
        return []
    total = max(space.chunk_min, min(room, round(_log_uniform(rng, space.chunk_min, room))))
    sizes = [total]
    two = seats >= 2 and rng.random() < space.two_chunk_share
    if total >= 2 * space.chunk_min and two:
        first = rng.randint(space.chunk_min, total - space.chunk_min)
        sizes = [first, total - first]
    chunks = []
    for size in sizes:
        prefix = 0
        room_before = min(space.prefix_max, space.max_model_len - size)
        if room_before >= 16 and rng.random() < space.prefix_share:
            prefix = rng.randint(16, room_before)
        chunks.append((prefix, size))
    return chunks


def sample_step(
    rng: random.Random, max_kv_tokens: int, space: StepSpace
) -> tuple[list[int], Chunks]:
    """(decode contexts, prompt chunks) of one random step (see the module docstring)."""
    while True:
        contexts = sample_contexts(rng, max_kv_tokens, space)
        chunks = sample_chunks(rng, len(contexts), space)
        cached = sum(contexts) + len(contexts) + sum(p + n for p, n in chunks)
        if cached <= max_kv_tokens:
            return contexts, chunks


def sample_decode(
    rng: random.Random,
    max_kv_tokens: int,
    prefill_choices: tuple[int, ...] = (0, 0, 0, 0, 64, 256, 512),
) -> tuple[list[int], int]:
    """Per-sequence contexts and prefill-chunk tokens of one random iteration (the earlier
    profiles' draw: batch 1..256, mean context 32..4096, a chunk size from the choices)."""
    while True:
        batch = max(1, round(math.exp(rng.uniform(0.0, math.log(256)))))
        mean = math.exp(rng.uniform(math.log(32), math.log(4096)))
        contexts = [max(1, round(mean * rng.uniform(0.5, 1.5))) for _ in range(batch)]
        if batch * (max(contexts) + 1) <= max_kv_tokens:
            return contexts, rng.choice(prefill_choices)


def sample_finetune(rng: random.Random, max_tokens: int = 4096) -> tuple[int, int, int]:
    """(tokens, seq_len, lora_rank) of one random quantum: ``micro_batch`` (1, 2, 4 or 8)
    examples of ``seq_len`` tokens, at most ``max_tokens`` (at least one 256-token example)."""
    seq_len = rng.choice([s for s in (256, 512, 1024, 2048) if s <= max(max_tokens, 256)])
    micro_batch = rng.choice([m for m in (1, 2, 4, 8) if m * seq_len <= max(max_tokens, seq_len)])
    return micro_batch * seq_len, seq_len, rng.choice((8, 16, 64))


def attention_pairs(chunks: Chunks) -> int:
    """(query, key) pairs of the chunks' causal attention: sum of n x (prefix + (n + 1) / 2)."""
    return sum(n * prefix + n * (n + 1) // 2 for prefix, n in chunks)
