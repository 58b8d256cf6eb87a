"""The seeded trace of ``python -m bench.prefix_cache``: every request is one shared system
prompt followed by its own user part, generating a fixed number of tokens (ignoring eos).

* system prompt: ``system_prompt`` token ids uniform over the vocabulary (one draw per trace);
* user part: length uniform in ``[user_min, user_max]``, token ids uniform (per request);
* arrivals: Poisson at ``rate`` per second (exponential gaps from the first request at 0 s),
  or all at 0 s for a burst.
The system prompt derives from ``system_seed``, everything else from ``seed`` (`random.Random`):
caching on and off replay the same trace, and traces of one ``system_seed`` share their prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TracedRequest:
    """One request of the trace."""

    arrival_s: float
    """Seconds after the replay starts."""
    prompt: list[int]
    user_tokens: int


def build_trace(
    *,
    vocab_size: int,
    system_prompt: int,
    user_min: int,
    user_max: int,
    requests: int,
    rate: float | None,
    seed: int,
    system_seed: int,
) -> list[TracedRequest]:
    """`requests` requests sharing one system prompt; Poisson arrivals at `rate` (None: all at
    0 s). The same arguments give the same trace."""
    system_rng = random.Random(system_seed)
    system = [system_rng.randrange(vocab_size) for _ in range(system_prompt)]
    rng = random.Random(seed)
    out: list[TracedRequest] = []
    now = 0.0
    for index in range(requests):
        if rate is not None and index > 0:
            now += rng.expovariate(rate)
        user = rng.randint(user_min, user_max)
        prompt = system + [rng.randrange(vocab_size) for _ in range(user)]
        out.append(TracedRequest(now if rate is not None else 0.0, prompt, user))
    return out
