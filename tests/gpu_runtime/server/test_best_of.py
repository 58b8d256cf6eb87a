"""`best_of`'s pick: the `n` sequences of highest cumulative logprob, highest first, ties in
generation order; all sequences in order when no more than `n` were generated."""

from __future__ import annotations

from gpu_runtime.engine.request import TokenLogprob
from gpu_runtime.server.choices import best, cumulative_logprob
from gpu_runtime.server.responses import Tracked


def _seq(*logprobs: float) -> Tracked:
    return Tracked(3, logprobs=[TokenLogprob(i, v, ()) for i, v in enumerate(logprobs)])


def test_best_ranks_by_the_sum_of_the_sampled_logprobs() -> None:
    seqs = [_seq(-1.0, -1.0), _seq(-0.5), _seq(-0.1, -0.2, -0.3), _seq(-2.0), _seq(-0.5)]
    assert [cumulative_logprob(s) for s in seqs] == [-2.0, -0.5, -0.1 - 0.2 - 0.3, -2.0, -0.5]

    def picked(n: int) -> list[int]:  # positions, by identity (tied sequences are equal)
        return [next(i for i, s in enumerate(seqs) if s is chosen) for chosen in best(seqs, n)]

    assert picked(3) == [1, 4, 2]  # -0.5, -0.5 (the tie in generation order), -0.6
    assert picked(1) == [1]
    assert picked(5) == [0, 1, 2, 3, 4]  # as many as asked: generation order


def test_best_of_a_sequence_without_tokens_is_zero() -> None:
    assert cumulative_logprob(Tracked(3)) == 0.0
