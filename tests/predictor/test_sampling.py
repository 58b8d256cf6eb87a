"""Steps the profiler draws stay inside the deployment's limits and cover its token buckets."""

from __future__ import annotations

import random

import pytest

from predictor_models.sampling import StepSpace, attention_pairs, sample_step

SPACE = StepSpace(
    max_batch=64,
    context_range=(32.0, 2048.0),
    max_model_len=2048,
    token_budget=512,
    chunk_share=0.5,
    prefix_share=0.3,
    prefix_max=1024,
    two_chunk_share=0.2,
)


def test_steps_respect_the_engine_limits_and_cover_every_token_bucket() -> None:
    rng = random.Random(0)
    buckets: set[int] = set()
    kinds = {"decode": 0, "chunk": 0, "prefix": 0, "two": 0}
    for _ in range(2000):
        contexts, chunks = sample_step(rng, 150_000, SPACE)
        assert 1 <= len(contexts) <= 64 and max(contexts) + 2 <= 2048
        assert len(contexts) + len(chunks) <= 64  # prompts are sequences of the step too
        tokens = len(contexts) + sum(n for _, n in chunks)
        assert tokens <= 512
        assert all(n >= 16 and p + n <= 2048 for p, n in chunks)
        if chunks:
            kinds["chunk"] += 1
            buckets.add(next(b for b in (64, 128, 256, 512) if b >= tokens))
            kinds["prefix"] += any(p for p, _ in chunks)
            kinds["two"] += len(chunks) == 2
        else:
            kinds["decode"] += 1
    assert buckets == {64, 128, 256, 512}
    assert 0.4 < kinds["chunk"] / 2000 < 0.6
    assert kinds["prefix"] > 0.2 * kinds["chunk"] and kinds["two"] > 0.1 * kinds["chunk"]


def test_no_chunks_without_a_share_and_invalid_spaces_are_refused() -> None:
    rng = random.Random(1)
    plain = StepSpace(max_batch=64, token_budget=512)
    assert all(not sample_step(rng, 150_000, plain)[1] for _ in range(200))
    with pytest.raises(ValueError, match="chunk_share"):
        StepSpace(chunk_share=1.5)
    with pytest.raises(ValueError, match="leaves no chunk"):
        StepSpace(max_batch=64, token_budget=70, chunk_share=0.5)


def test_attention_pairs_count_the_prefix_and_the_causal_triangle() -> None:
    assert attention_pairs([]) == 0
    assert attention_pairs([(0, 4)]) == 10  # 1 + 2 + 3 + 4
    assert attention_pairs([(10, 4), (0, 1)]) == 40 + 10 + 1
