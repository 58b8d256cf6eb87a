"""The choices Harli weighs before a decode iteration, and the checks each must pass.

:class:`ChoiceEnumerator` lists the options of one plan, each with its predicted TPOT and its
expected finetune tokens/s: whole quanta beside decode on a split or shared (``spatial``),
whole quanta after decode (``after_decode``), layer-sliced quanta either way
(``layer_sliced``) and quanta alone while decode is idle (``idle``). It reads the estimators
`HarliPolicy` (``harli.py``) feeds (quantum durations, slice costs, launch overhead) and asks
`TypicalPredictions` (``typical.py``) for the latency model's answers; it learns nothing
itself. The policy picks among its choices, tracks the margin and learns from what happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.colocation.estimates import LaunchOverhead, QuantumDurations
from gpu_runtime.colocation.harli_config import HarliConfig
from gpu_runtime.colocation.latency_model import DecodeLatencyModel
from gpu_runtime.colocation.slicing import SliceCosts, SliceState
from gpu_runtime.colocation.types import (
    IterationContext,
    JobView,
    LaunchMode,
)
from gpu_runtime.colocation.typical import Typical, TypicalPredictions, fits_bound


@dataclass(frozen=True)
class Choice:
    decode_sms: int | None
    mode: LaunchMode | None
    examples: int
    predicted_ms: float
    value: float
    quantum_ms: float | None
    max_layers: int | None = None
    slice_base_ms: float = 0.0
    """Uncorrected slice estimate (what `SliceCosts` learns its correction against)."""


class ChoiceEnumerator:
    """Enumerates and predicts Harli's choices (see the module docstring).

    ``latency`` is the model ``predictions`` asks (read here only for whether its predictions
    depend on the quantum's size); ``durations``, ``slice_costs`` and ``launch_overhead`` are
    the policy's estimators, read at every call and learnt by the policy alone."""

    def __init__(
        self,
        config: HarliConfig,
        latency: DecodeLatencyModel,
        predictions: TypicalPredictions,
        durations: QuantumDurations,
        slice_costs: SliceCosts,
        launch_overhead: LaunchOverhead,
    ) -> None:
        self.config = config
        self.latency = latency
        self.predictions = predictions
        self.durations = durations
        self.slice_costs = slice_costs
        self.launch_overhead = launch_overhead
        self.risk_rejections = 0
        """Choices turned down because a running request would miss the SLO with them."""

    def _beside_predicted(
        self,
        ctx: IterationContext,
        job: JobView,
        share: float,
        tokens: int,
        bound: float,
        typical_alone: Typical,
        examples: int = 0,
        decode_sms: int | None = None,
    ) -> float | None:
        """Predicted TPOT of the coming iteration with a ``tokens``-token quantum launched
        beside decode on ``share`` of the SMs (the launch's own cost, ``launch_overhead``,
        included), or None when the choice is unsafe.

        The quantum holds this split for its whole duration, and a request's TPOT is a mean
        over many iterations: the typical iteration while it runs (the queue joined, the recent
        mix of chunk and pure decode steps) must stay under the bound, this one (the launch's
        cost aside) under the SLO, and every running request, its remaining tokens at that
        typical iteration and the launch's cost in one gap, must end under the bound
        (:meth:`_running_keep_slo`). The launch's cost is one longer gap, which a request's
        mean spreads over its tokens: gating every launch on it would stop all finetuning
        once one slow launch was seen under a tight SLO
        (docs/decisions/0014-harli-plan-rules.md)."""
        memo = self.predictions.plan_memo(ctx)
        size_free = getattr(self.latency, "quantum_size_independent", False)
        key = (share, 0 if size_free else tokens)
        if key not in memo:
            self.predictions.prefetch(ctx, job, [share], [tokens], bound)
        predicted, _, remembered = memo[key]
        if not fits_bound(memo[key], bound, ctx.tpot_slo_ms):
            return None
        launch = self.launch_ms(job, examples, decode_sms)  # one gap, not a rate
        # Running requests are projected with the remembered mix: a burst's chunk steps may
        # come back while the quantum holds its split, and they have no later lull to wait for.
        if not self._running_keep_slo(ctx, bound, remembered, typical_alone[1], once=launch):
            return None
        return predicted + launch

    def launch_ms(self, job: JobView, examples: int, decode_sms: int | None) -> float:
        """What launching ``examples`` beside decode on ``decode_sms`` adds to the coming
        iteration: the learnt launch overhead, plus ``cold_launch_ms`` when the micro-batch has
        no graph on that split's stream yet."""
        cold = (examples, decode_sms) in job.cold_launches
        return self.launch_overhead.ms + (self.config.cold_launch_ms if cold else 0.0)

    def _running_keep_slo(
        self, ctx: IterationContext, bound: float, with_ms: float, alone_ms: float, once: float = 0
    ) -> bool:
        """Whether every running request that would end within the SLO if its remaining
        iterations took ``alone_ms`` still ends within it if they take ``with_ms`` (plus
        ``once`` ms added to one gap), the margin applied to those remaining iterations alone:
        they are predicted, the gaps a request has had are known. (``bound`` is the SLO less
        the margin; a request with nothing decoded yet must keep its iterations under it.) A
        request that misses the SLO even alone is lost to finetuning or not, so it does not
        hold finetuning back."""
        horizon = self.config.unknown_remaining_tokens
        slo = ctx.tpot_slo_ms
        inflate = slo / bound if bound > 0 else float("inf")
        for request in ctx.running:
            left = request.remaining_tokens if request.remaining_tokens is not None else horizon
            spread = once / max(request.tokens - 1 + left, 1)
            if request.final_tpot_ms(with_ms * inflate, horizon) + spread * inflate <= slo:
                continue
            if request.final_tpot_ms(alone_ms, horizon) <= slo:
                self.risk_rejections += 1
                return False
        return True

    def spatial(
        self,
        ctx: IterationContext,
        job: JobView,
        d: int | None,
        total: int | None,
        sizes: list[int],
        bound: float,
    ) -> list[Choice]:
        """Whole quanta of ``sizes`` examples beside decode on ``d`` of ``total`` SMs (the
        whole device: shared), smallest first, up to the first size unsafe beside decode; a
        quantum longer than ``max_quantum_ms`` is skipped unless it is the smallest."""
        share = 1.0 if not total or d is None else d / total
        ft_share = 1.0 if share >= 1.0 else 1.0 - share
        typical_alone = self.predictions.typical_alone(ctx)
        out: list[Choice] = []
        for k in sizes:
            tokens = k * job.max_seq_len
            predicted = self._beside_predicted(ctx, job, share, tokens, bound, typical_alone, k, d)
            if predicted is None:
                if (k, d) in job.cold_launches:
                    continue  # a graph not yet there: a bigger size may replay one
                break  # a bigger quantum beside decode is assumed no kinder to it
            quantum_ms = self.durations.duration_ms(
                job, d, LaunchMode.CONCURRENT, ft_share, k * job.seq_len
            )
            if quantum_ms > self.config.max_quantum_ms and k != sizes[0]:
                continue
            value = k * job.seq_len / ((quantum_ms + predicted / 2) / 1e3)
            out.append(Choice(d, LaunchMode.CONCURRENT, k, predicted, value, quantum_ms))
        return out

    def layer_sliced(
        self,
        ctx: IterationContext,
        job: JobView,
        state: SliceState,
        full: int | None,
        sizes: list[int],
        bound: float,
        solo_full: float,
    ) -> list[Choice]:
        """Layer-sliced choices: after decode within the slack (where a whole quantum never
        fits), or, to finish a micro-batch in progress, beside decode on a split (a whole
        quantum, CUDA-graphed, is the better use of a split otherwise). A slice's value counts
        its share of the micro-batch's tokens (passes / all passes)."""
        layers = state.layers
        if state.active:
            widths = sorted({*self.config.layer_slices, state.passes_left})
        else:  # a whole micro-batch in one eager call is never better than a whole quantum
            widths = sorted(k for k in self.config.layer_slices if k < 2 * layers)
        examples = [state.examples] if state.active else sizes
        total = ctx.total_sms
        idle = ctx.decode.is_idle
        splits: list[int | None] = []
        if state.active and total and ctx.spatial:
            splits += list(ctx.decode_sms_options[:-1])
        if state.active and self.config.allow_shared and not idle:
            splits.append(full)
        typical_alone = self.predictions.typical_alone(ctx) if splits else (0.0, 0.0)
        out: list[Choice] = []
        for e in examples:
            tokens = e * job.max_seq_len
            work = e * job.seq_len
            if self.config.allow_slice and not idle:
                whole = self.durations.duration_ms(job, None, LaunchMode.AFTER_DECODE, 1.0, work)
                for k in widths:
                    forward, backward = state.passes_for(k)
                    base = self.slice_costs.base_ms(whole, layers, forward, backward)
                    correction = self.slice_costs.correction(None, LaunchMode.AFTER_DECODE)
                    ms = base * correction
                    predicted = solo_full + ms
                    # A forward slice of w layers comes back as a backward call of >= w layers
                    # (twice the work): take only widths whose backward would fit this slack too.
                    later = self.slice_costs.base_ms(whole, layers, 0, forward) * correction
                    if predicted > bound or solo_full + later > bound:
                        continue
                    value = work * (forward + backward) / (2 * layers) / (predicted / 1e3)
                    out.append(
                        Choice(full, LaunchMode.AFTER_DECODE, e, predicted, value, ms, k, base)
                    )
            for d in splits:
                share = 1.0 if not total or d is None else d / total
                predicted_beside = self._beside_predicted(
                    ctx, job, share, tokens, bound, typical_alone
                )
                if predicted_beside is None:
                    continue
                ft_share = 1.0 if share >= 1.0 else 1.0 - share
                whole = self.durations.duration_ms(job, d, LaunchMode.CONCURRENT, ft_share, work)
                # Slices are eager (host work that shares the GIL with decode): beside decode,
                # never wider than the configured widths: a wider slice finishing a
                # micro-batch holds decode back for its whole duration
                # (docs/decisions/0014-harli-plan-rules.md).
                for k in (w for w in widths if w <= max(self.config.layer_slices)):
                    forward, backward = state.passes_for(k)
                    # Measured alone on the whole device; on fewer SMs at least the split's
                    # share of a whole quantum there.
                    base = max(
                        self.slice_costs.base_ms(whole, layers, forward, backward),
                        self.slice_costs.spread_ms(whole, layers, forward, backward),
                    )
                    ms = base * self.slice_costs.correction(d, LaunchMode.CONCURRENT)
                    # Relaunched at the next iteration's start once it has finished.
                    gap = predicted_beside
                    cycle = gap if ms <= gap else ms + gap / 2
                    value = work * (forward + backward) / (2 * layers) / (cycle / 1e3)
                    out.append(
                        Choice(d, LaunchMode.CONCURRENT, e, predicted_beside, value, ms, k, base)
                    )
        return out

    def after_decode(
        self,
        ctx: IterationContext,
        job: JobView,
        full: int | None,
        sizes: list[int],
        bound: float,
        solo_full: float,
    ) -> list[Choice]:
        """Whole quanta alone on the device after the decode step (``solo_full`` ms, decode
        alone on it): the two within ``bound``, the quantum one gap of every running request."""
        out: list[Choice] = []
        for k in sizes:
            quantum_ms = self.durations.duration_ms(
                job, None, LaunchMode.AFTER_DECODE, 1.0, k * job.seq_len
            )
            predicted = solo_full + quantum_ms
            if predicted <= bound and self._running_keep_slo(
                ctx, bound, solo_full, solo_full, once=quantum_ms
            ):
                value = k * job.seq_len / (predicted / 1e3)
                out.append(Choice(full, LaunchMode.AFTER_DECODE, k, predicted, value, quantum_ms))
        return out

    def idle(self, job: JobView, full: int | None, sizes: list[int]) -> list[Choice]:
        """Quanta alone on the whole device while decode is idle, of at most ``idle_slice_ms``
        expected duration (a request arriving meanwhile waits that long for its first token;
        its TPOT is untouched); valued at their own rate, as nothing decodes."""
        cap = self.config.idle_slice_ms
        cap = self.config.max_quantum_ms if cap is None else cap
        out: list[Choice] = []
        for k in sizes:
            quantum_ms = self.durations.duration_ms(
                job, None, LaunchMode.AFTER_DECODE, 1.0, k * job.seq_len
            )
            if 0 < quantum_ms <= cap:
                value = k * job.seq_len / (quantum_ms / 1e3)
                out.append(Choice(full, LaunchMode.AFTER_DECODE, k, 0.0, value, quantum_ms))
        return out
