"""Seeded request traces for the co-location benchmark (the same trace for every policy).

Arrivals:
  * ``poisson``: exponential inter-arrival times at ``rate_per_s``.
  * ``onoff`` (bursty): Poisson at ``rate_per_s`` during ``on_s``-second bursts separated by
    ``off_s`` seconds with no arrivals (mean rate ``rate_per_s * on_s / (on_s + off_s)``).
Lengths (tokens), drawn independently per request:
  * prompt: log-normal with median ``prompt_median`` and shape ``prompt_sigma`` (the sigma of the
    underlying normal), rounded, clipped to ``[prompt_min, prompt_max]``;
  * output: log-normal with median ``output_median`` and shape ``output_sigma``, clipped to
    ``[output_min, output_max]``; requests ignore eos and generate exactly that many tokens.
Prompt token ids are uniform over the vocabulary from a per-request seed. Everything derives from
``seed`` (``random.Random``), so a trace is identical across policies, runs and machines.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class LengthDistribution:
    """Clipped log-normal token count."""

    median: float
    sigma: float
    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        if not (0 < self.minimum <= self.median <= self.maximum) or self.sigma < 0:
            raise ValueError(f"invalid length distribution {self}")

    def draw(self, rng: random.Random) -> int:
        value = round(self.median * math.exp(rng.gauss(0.0, self.sigma)))
        return min(self.maximum, max(self.minimum, value))


@dataclass(frozen=True)
class TraceSpec:
    """One trace: arrival process, duration and length distributions."""

    name: str
    kind: str
    """``poisson`` or ``onoff``."""
    rate_per_s: float
    """Poisson rate (during bursts for ``onoff``)."""
    duration_s: float
    prompt: LengthDistribution
    output: LengthDistribution
    on_s: float = 1.0
    off_s: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "onoff"):
            raise ValueError(f"trace kind must be poisson or onoff, got {self.kind!r}")
        if self.rate_per_s <= 0 or self.duration_s <= 0 or self.on_s <= 0 or self.off_s < 0:
            raise ValueError(f"invalid trace timing in {self}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    token_seed: int

    def prompt_ids(self, vocab_size: int) -> list[int]:
        rng = random.Random(self.token_seed)
        return [rng.randrange(vocab_size) for _ in range(self.prompt_tokens)]


PROMPT = LengthDistribution(median=256, sigma=0.6, minimum=16, maximum=1024)
OUTPUT = LengthDistribution(median=128, sigma=0.5, minimum=16, maximum=384)

PRESETS: dict[str, TraceSpec] = {
    "low": TraceSpec("low", "poisson", 4.0, 5.0, PROMPT, OUTPUT),
    "medium": TraceSpec("medium", "poisson", 12.0, 5.0, PROMPT, OUTPUT),
    "high": TraceSpec("high", "poisson", 24.0, 5.0, PROMPT, OUTPUT),
    "bursty": TraceSpec("bursty", "onoff", 30.0, 5.0, PROMPT, OUTPUT, on_s=1.0, off_s=1.0),
}
"""Rates chosen for a Llama-3-8B-shaped model on one H200 (see bench/colocate/run.py): ``low`` keeps
a handful of sequences running, ``high`` a few dozen, ``bursty`` swings between both."""


def preset(name: str, duration_s: float | None = None, rate_scale: float = 1.0) -> TraceSpec:
    """A named trace, optionally shortened and with its rate scaled (e.g. for a tiny model)."""
    try:
        spec = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; choose from {sorted(PRESETS)}") from None
    return replace(
        spec,
        duration_s=duration_s if duration_s is not None else spec.duration_s,
        rate_per_s=spec.rate_per_s * rate_scale,
    )


def generate(spec: TraceSpec, seed: int) -> list[TraceRequest]:
    """The requests of ``spec`` arriving within its duration, in arrival order."""
    rng = random.Random(f"{spec.name}:{seed}")
    requests: list[TraceRequest] = []
    t = 0.0
    period = spec.on_s + spec.off_s
    while True:
        t += rng.expovariate(spec.rate_per_s)
        if spec.kind == "onoff" and (t % period) >= spec.on_s:
            t = (t // period + 1) * period  # skip the off phase; next burst starts here
            continue
        if t >= spec.duration_s:
            return requests
        requests.append(
            TraceRequest(
                index=len(requests),
                arrival_s=t,
                prompt_tokens=spec.prompt.draw(rng),
                output_tokens=spec.output.draw(rng),
                token_seed=rng.randrange(2**31),
            )
        )
