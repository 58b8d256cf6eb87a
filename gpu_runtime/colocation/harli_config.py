"""Knobs of the Harli policy (`HarliConfig`), their defaults and why they are what they are.

What each knob does in a plan is in ``harli.py``'s module docstring; the checks are here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GPU_LAUNCH_OVERHEAD_PRIOR_MS = 3.0
"""Extra ms charged to a host's first concurrent launch, before any launch was timed: a first
launch costs more than predicted, and charged nothing that excess would go into the margin's
error window and raise the margin at every trace's start
(docs/decisions/0014-harli-plan-rules.md)."""
GPU_MAX_QUANTUM_MS = 150.0
"""GPU hosts' cap on a quantum's expected duration: longer quanta keep decode on a split for
longer than the SLO allows at high load (docs/decisions/0013-quantum-sizing-and-splits.md)."""


@dataclass(frozen=True)
class HarliConfig:
    """Knobs of the Harli policy (see the module docstring)."""

    base_margin: float = 0.03
    """Margin kept even when predictions have been exact (fraction of the SLO)."""
    max_margin: float = 0.5
    """Cap on the adaptive margin."""
    error_quantile: float = 0.9
    """Quantile of recent relative under-prediction errors (each a mean over
    ``error_smoothing`` iterations) added to the margin."""
    error_window: int = 256
    """Busy iterations the error quantile is taken over (those that predicted nothing, in a
    plan backoff, count too: the window is a span of time, not a number of predictions)."""
    error_smoothing: int = 32
    """Iterations each error (and each SLO breach check) is averaged over: a share of a
    request's life (a few hundred tokens), over which its mean TPOT is made; also the horizon
    of the typical-iteration mix."""
    min_error_samples: int = 8
    """Below this many observations the margin is ``initial_margin``."""
    initial_margin: float = 0.15
    """Margin used before enough errors were observed."""
    initial_margin_predictions: int = 256
    """Predictions over which ``initial_margin`` fades out linearly as a floor under the
    learnt margin (0: none, the learnt margin from ``min_error_samples`` on). Each error is a
    mean over ``error_smoothing`` iterations, so the first few dozen overlap and say little
    about the 0.9 quantile; without the floor the margin falls to its base while requests are
    still arriving (docs/decisions/0010-launch-inside-decode-step.md)."""
    violation_step: float = 0.05
    """Margin added when a request misses the SLO (once per episode)."""
    violation_decay: float = 0.98
    """Per-iteration decay factor of that extra margin."""
    quantum_examples: tuple[int, ...] = (1, 2, 4, 8)
    """Quantum sizes considered, in examples of the job's longest length."""
    unknown_remaining_tokens: int = 64
    """Tokens assumed still to come for a running request whose limit is unknown, when
    projecting its final mean TPOT (``IterationContext.running``)."""
    prefill_smoothing: float = 0.05
    """EMA weight of one busy iteration in how often a step carries a prefill chunk and how
    big it is then (``PrefillMix``: the typical iterations a held split must keep fast)."""
    prefill_memory_smoothing: float | None = 0.005
    """EMA weight of a slower chunk share. Running requests are projected to their end with the
    larger of it and the recent share (the launch bound keeps the recent one), so a burst's
    chunk steps weigh for ~200 busy iterations (1-2 s) after it: a quantum launched in a lull
    holds its split into the next burst (docs/decisions/0014-harli-plan-rules.md). None: the
    recent share alone."""
    idle_probe_context_tokens: int = 512
    """When decode is idle, quanta beside decode are planned as if one request of this context
    were decoding (one may arrive while the quantum holds its split)."""
    idle_slice_ms: float | None = None
    """When decode is idle, a quantum alone on the whole device is also considered if its
    expected duration is at most this (time slicing): a request that arrives meanwhile waits
    for it, so its first token comes up to this much later while its TPOT is untouched. None:
    ``max_quantum_ms``; 0: never (idle quanta only beside decode on a split). Why idle quanta
    run alone: docs/decisions/0014-harli-plan-rules.md."""
    cold_launch_ms: float = 300.0
    """Loop time a concurrent launch costs once when its micro-batch has no CUDA graph on that
    split's stream yet (``JobView.cold_launches``: first warm-up or capture, a few hundred ms),
    charged like the launch overhead: one gap of every running request."""
    max_quantum_ms: float = 250.0
    """Cap on a quantum's expected duration (the smallest size is exempt)."""
    prior_quantum_overhead_ms: float = 0.0
    """Fixed cost per quantum assumed before two quantum sizes were timed on a choice."""
    launch_overhead_prior_ms: float = 0.0
    """Extra ms a concurrent launch's iteration is charged before any launch was timed
    (`LaunchOverhead`; learnt from then on). GPU hosts use `GPU_LAUNCH_OVERHEAD_PRIOR_MS`."""
    allow_shared: bool = True
    """Consider a quantum beside decode on the whole device (no spatial split)."""
    allow_slice: bool = True
    """Consider a quantum after the decode step (time slicing)."""
    slice_call_ms: float | None = None
    """Measured fixed cost of one layer-sliced call (with the two below; None: slices are
    priced as their share of a whole quantum's expected duration)."""
    slice_forward_layer_ms: float | None = None
    """Measured cost of one forward layer pass in a slice."""
    slice_backward_layer_ms: float | None = None
    """Measured cost of one backward layer pass in a slice."""
    replan_backoff: int = 4
    """After ``n`` plans in a row found nothing safe, the next ``min(n, replan_backoff)`` busy
    iterations pause without asking the model (until a running request finishes): under
    overload every plan finds nothing, and its predictions would cost host time on every token
    (docs/decisions/0014-harli-plan-rules.md). 0: plan every iteration."""
    layer_slices: tuple[int, ...] = (1, 2, 4, 8, 16)
    """``max_layers`` values of layer-sliced quanta considered (jobs whose layer count is
    known); a micro-batch in progress only continues in slices. Empty: whole quanta only."""

    def __post_init__(self) -> None:
        if not 0 <= self.base_margin <= self.max_margin < 1:
            raise ValueError(
                f"need 0 <= base_margin ({self.base_margin}) <= max_margin ({self.max_margin}) < 1"
            )
        if self.idle_slice_ms is not None and self.idle_slice_ms < 0:
            raise ValueError(f"idle_slice_ms must be >= 0 or None, got {self.idle_slice_ms}")
        if self.initial_margin_predictions < 0:
            raise ValueError(
                f"initial_margin_predictions must be >= 0, got {self.initial_margin_predictions}"
            )
        if not 0 <= self.initial_margin < 1:
            raise ValueError(f"initial_margin must be in [0, 1), got {self.initial_margin}")
        if not 0.5 <= self.error_quantile <= 1.0:
            raise ValueError(f"error_quantile must be in [0.5, 1], got {self.error_quantile}")
        if not self.quantum_examples or min(self.quantum_examples) < 1:
            raise ValueError(f"quantum_examples must be positive, got {self.quantum_examples}")
        if self.replan_backoff < 0:
            raise ValueError(f"replan_backoff must be >= 0, got {self.replan_backoff}")
        if self.layer_slices and min(self.layer_slices) < 1:
            raise ValueError(f"layer_slices must be positive, got {self.layer_slices}")
        if self.launch_overhead_prior_ms < 0:
            raise ValueError(
                f"launch_overhead_prior_ms must be >= 0, got {self.launch_overhead_prior_ms}"
            )
        if self.max_quantum_ms <= 0 or self.prior_quantum_overhead_ms < 0:
            raise ValueError(
                f"max_quantum_ms ({self.max_quantum_ms}) must be > 0 and "
                f"prior_quantum_overhead_ms ({self.prior_quantum_overhead_ms}) >= 0"
            )


IDLE_SLICE_TTFT_SHARE = 0.5
"""Share of a deployment's TTFT SLO an idle time slice may take: a request arriving during one
waits up to its length for its first token and keeps the rest for queueing and its prefill."""


def host_harli_config(device: str, ttft_slo_ms: float | None = None) -> HarliConfig:
    """Harli's knobs on a runtime host: on CUDA a first launch is charged
    `GPU_LAUNCH_OVERHEAD_PRIOR_MS` and quanta are capped at `GPU_MAX_QUANTUM_MS`; with the
    deployment's `ttft_slo_ms`, idle time slices are at most `IDLE_SLICE_TTFT_SHARE` of it (and
    never over `max_quantum_ms`): an idle slice delays the first token of a request arriving
    meanwhile (docs/decisions/0014-harli-plan-rules.md)."""
    if ttft_slo_ms is not None and not ttft_slo_ms > 0:
        raise ValueError(f"ttft_slo_ms must be > 0 or None, got {ttft_slo_ms}")
    base = HarliConfig()
    gpu = device.startswith("cuda")
    prior = GPU_LAUNCH_OVERHEAD_PRIOR_MS if gpu else 0.0
    cap = GPU_MAX_QUANTUM_MS if gpu else base.max_quantum_ms
    idle = None
    if ttft_slo_ms is not None:
        idle = min(cap, IDLE_SLICE_TTFT_SHARE * ttft_slo_ms)
    return replace(base, launch_overhead_prior_ms=prior, idle_slice_ms=idle, max_quantum_ms=cap)
