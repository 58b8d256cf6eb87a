"""Token-bucket arithmetic shared by the limiters (plain floats, no clock, no storage).

A bucket of capacity C (the per-minute limit) holds a level between 0 and C. It starts full
and refills continuously at C/60 per second, never past C; a call that costs n takes n from
it, and is refused, taking nothing, when the level is below n. This is how OpenAI describes
its per-minute limits: a limit of 60 requests per minute is one request a second, with bursts
of up to 60 when the bucket is full. `RedisRateLimiter`'s Lua script does the same arithmetic.
"""

from __future__ import annotations

import math

SECONDS_PER_MINUTE = 60.0
# Float slack when reading a level as a whole count (9.999999999 is 10 after refills).
_EPSILON = 1e-9


def check_integer(name: str, value: int, *, minimum: int | None = None) -> None:
    """Refuse (ValueError) anything but an integer (a bool is not one) of at least `minimum`."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def refilled(level: float, elapsed_s: float, capacity: int) -> float:
    """The level after `elapsed_s` seconds of refill (a clock step backwards refills nothing)."""
    return min(float(capacity), level + max(0.0, elapsed_s) * capacity / SECONDS_PER_MINUTE)


def clamped(level: float, capacity: int) -> float:
    """`level` kept within [0, capacity]."""
    return min(float(capacity), max(0.0, level))


def holds(level: float, cost: float) -> bool:
    """Whether a bucket at `level` can pay `cost`."""
    return level + _EPSILON >= cost


def seconds_until(level: float, needed: float, capacity: int) -> float | None:
    """Seconds until a bucket at `level` holds `needed`; 0 if it does; None if it never can
    (`needed` is more than the capacity)."""
    if needed > capacity:
        return None
    if holds(level, needed):
        return 0.0
    return (needed - level) * SECONDS_PER_MINUTE / capacity


def seconds_to_full(level: float, capacity: int) -> float:
    """Seconds until the bucket is full again (OpenAI's `x-ratelimit-reset-*`)."""
    wait = seconds_until(level, capacity, capacity)
    assert wait is not None  # capacity always fits in itself
    return wait


def whole(level: float) -> int:
    """The level as the count a client may still spend (`x-ratelimit-remaining-*`)."""
    return max(0, math.floor(level + _EPSILON))
