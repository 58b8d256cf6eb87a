"""Batched predictions of the iterations a quantum launched now would run beside.

:class:`TypicalPredictions` asks the latency model what `HarliPolicy` needs to weigh a
choice: for a decode share and a quantum size, the coming iteration and the *typical* one while
the quantum holds its split (a mix of pure decode steps and steps carrying a prefill chunk,
weighted by how often each kind has come: the policy's ``PrefillMix``, which it reads and never
updates), under the recent and the remembered mix, all of one plan in one batched call and
memoised for that plan. The policy and its `ChoiceEnumerator` (``choices.py``) hold the same
instance, so a plan's predictions are made once whichever of them asks first.
"""

from __future__ import annotations

from gpu_runtime.colocation.estimates import PrefillMix
from gpu_runtime.colocation.latency_model import (
    DecodeLatencyModel,
    Pair,
    decode_iteration,
    predict_many,
)
from gpu_runtime.colocation.types import DecodeSnapshot, IterationContext, JobView
from gpu_runtime.predictor.schema import FinetuneQuantum

Mix = tuple[tuple[float, float, DecodeSnapshot], ...]
"""(recent weight, remembered weight, snapshot) of the kinds of iteration expected while a
quantum runs (`PrefillMix.kinds`)."""

Typical = tuple[float, float]
"""An expected iteration under the recent mix (the bound a launch must keep), and under the
remembered one (what running requests are projected with)."""


def moves_to_whole(on_split_ms: float, on_whole_ms: float, bound: float) -> bool:
    """Whether decode leaves the split a quantum holds for the whole device (beside the
    quantum's SMs): the split predicted over the bound and the whole device faster. The
    in-flight plan decides by it, and a launch prices the iterations it will hold by it."""
    return on_split_ms > bound and on_whole_ms < on_split_ms - 1e-9


def fits_bound(prediction: tuple[float, float, float], bound: float, slo_ms: float) -> bool:
    """Whether a quantum beside decode passes the first checks of a choice (a memo entry: the
    coming iteration, the typical one under the recent mix, under the remembered one): the
    typical iteration under ``bound``, the coming one under the SLO itself."""
    now, typical, _ = prediction
    return typical <= bound and now <= slo_ms


class TypicalPredictions:
    """The latency model's answers for one plan (see the module docstring)."""

    def __init__(self, latency: DecodeLatencyModel, prefill: PrefillMix) -> None:
        self.latency = latency
        self._prefill = prefill
        self._typical_cache: tuple[IterationContext, tuple[float, float, float], Mix] | None = None
        self._memo_ctx: IterationContext | None = None
        self._memo_prefill: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._memo: dict[tuple[float, int], tuple[float, float, float]] = {}
        """(now, typical under the recent mix, under the remembered one) by (share, tokens)."""
        self._memo_alone: Typical | None = None

    def _typical_mix(self, ctx: IterationContext) -> Mix:
        """`PrefillMix.kinds` of ``ctx.decode``, computed once per context."""
        state = (self._prefill.share, self._prefill.remembered, self._prefill.tokens)
        cached = self._typical_cache
        if cached is None or cached[0] is not ctx or cached[1] != state:
            cached = (ctx, state, self._prefill.kinds(ctx.decode))
            self._typical_cache = cached
        return cached[2]

    def typical_ms(
        self,
        decode: DecodeSnapshot,
        share: float,
        quantum: FinetuneQuantum | None,
        bound: float | None = None,
    ) -> float:
        """Expected latency of the iterations after ``decode`` (the waiting requests joined;
        with and without a prefill chunk, weighted by how often each kind has come). With
        ``bound`` and a quantum on a split, a chunk step over the bound there is priced on the
        whole device when faster, as the in-flight plan runs it (see ``prefetch``)."""
        mix = self._prefill.mix(decode)
        pairs: list[Pair] = [(decode_iteration(snap, share), quantum) for _, snap in mix]
        movable = bound is not None and share < 1.0 and quantum is not None
        if movable:
            pairs += [(decode_iteration(snap, 1.0), quantum) for _, snap in mix]
        values = predict_many(self.latency, pairs)
        held = values[: len(mix)]
        if movable:
            assert bound is not None
            for i, (_, snap) in enumerate(mix):
                whole = values[len(mix) + i]
                if snap.prefill_tokens > 0 and moves_to_whole(held[i], whole, bound):
                    held[i] = whole
        return sum(w * v for (w, _), v in zip(mix, held, strict=True))

    def prefetch(
        self,
        ctx: IterationContext,
        job: JobView | None,
        shares: list[float],
        token_counts: list[int],
        bound: float | None = None,
    ) -> None:
        """Ask the latency model, in one call (``predict_many``), for every prediction not yet
        in this plan's memo that whole quanta of ``token_counts`` tokens beside decode on
        ``shares`` may need (the coming and the typical iteration with each), and for the
        typical iteration alone.

        With ``bound``, a typical iteration carrying a prefill chunk on a split is priced as
        the in-flight plan will run it (``HarliPolicy._in_flight_plan``): on the whole device,
        beside the quantum's SMs, when it is predicted over the bound on the split and faster
        there: priced on the split, chunk steps would rule out splits they never run on
        (docs/decisions/0014-harli-plan-rules.md)."""
        memo = self.plan_memo(ctx)
        size_free = getattr(self.latency, "quantum_size_independent", False)
        mix = self._typical_mix(ctx)
        recent = [w for w, _, _ in mix]
        remembered = [w for _, w, _ in mix]
        chunked = [i for i, (_, _, snap) in enumerate(mix) if snap.prefill_tokens > 0]
        spans: list[tuple[tuple[float, int], int, bool]] = []  # (key, first pair, may move)
        pairs: list[Pair] = []
        for share in shares:
            ft_share = 1.0 if share >= 1.0 else 1.0 - share
            now = decode_iteration(ctx.decode, share)
            later = [decode_iteration(snap, share) for _, _, snap in mix]
            movable = bound is not None and share < 1.0 and bool(chunked)
            whole = [decode_iteration(mix[i][2], 1.0) for i in chunked] if movable else []
            for tokens in token_counts[:1] if size_free else token_counts:
                key = (share, 0 if size_free else tokens)
                if key in memo or any(key == k for k, _, _ in spans):
                    continue
                assert job is not None
                seq_len = max(job.seq_len, 1)
                quantum = FinetuneQuantum(tokens, seq_len, job.lora_rank, True, ft_share)
                spans.append((key, len(pairs), movable))
                pairs += [(now, quantum), *((it, quantum) for it in later)]
                pairs += [(it, quantum) for it in whole]
        alone = self._memo_alone is None
        if alone:
            pairs += [(decode_iteration(snap, 1.0), None) for _, _, snap in mix]
        values = predict_many(self.latency, pairs)

        def typical(row: list[float]) -> Typical:
            return (
                sum(w * v for w, v in zip(recent, row, strict=True)),
                sum(w * v for w, v in zip(remembered, row, strict=True)),
            )

        for key, first, movable in spans:
            row = values[first + 1 : first + 1 + len(mix)]
            if movable:
                assert bound is not None
                moved = values[first + 1 + len(mix) : first + 1 + len(mix) + len(chunked)]
                for i, on_whole in zip(chunked, moved, strict=True):
                    if moves_to_whole(row[i], on_whole, bound):
                        row[i] = on_whole
            memo[key] = (values[first], *typical(row))
        if alone:
            self._memo_alone = typical(values[len(pairs) - len(mix) :])

    def prefetch_open(
        self,
        ctx: IterationContext,
        job: JobView,
        shares: list[float],
        token_counts: list[int],
        bound: float,
    ) -> None:
        """Predictions for the choices in two batched calls: the smallest quantum on every
        share, then the bigger ones only on the shares where the smallest fits (a bigger
        quantum is assumed no kinder to decode, so the others are never looked at)."""
        self.prefetch(ctx, job, shares, token_counts[:1], bound)
        if len(token_counts) < 2 or getattr(self.latency, "quantum_size_independent", False):
            return
        memo = self.plan_memo(ctx)
        fits = [
            share
            for share in shares
            if (m := memo.get((share, token_counts[0]))) is not None
            and fits_bound(m, bound, ctx.tpot_slo_ms)
        ]
        if fits:
            self.prefetch(ctx, job, fits, token_counts[1:], bound)

    def typical_alone(self, ctx: IterationContext) -> Typical:
        """The typical iteration of decode alone on the whole device (recent, remembered)."""
        self.prefetch(ctx, None, [], [])
        assert self._memo_alone is not None
        return self._memo_alone

    def plan_memo(
        self, ctx: IterationContext
    ) -> dict[tuple[float, int], tuple[float, float, float]]:
        """(now, typical under the recent mix, typical under the remembered one) predictions
        already made for this context, by (share, tokens): one plan asks the same ones for
        every quantum size."""
        # The context itself is held (not its id, which a later context could reuse).
        state = (self._prefill.share, self._prefill.remembered, self._prefill.tokens)
        if self._memo_ctx is not ctx or self._memo_prefill != state:
            self._memo_ctx, self._memo_prefill = ctx, state
            self._memo = {}
            self._memo_alone = None
        return self._memo
