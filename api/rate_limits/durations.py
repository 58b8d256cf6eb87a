"""Durations written as OpenAI writes its `x-ratelimit-reset-*` headers."""

from __future__ import annotations

import math


def openai_duration(seconds: float) -> str:
    """`seconds` in Go's duration notation, as OpenAI sends it: "20ms", "1s", "1.5s", "6m0s",
    "1h0m0s"; "0s" for zero.

    Rounded up to whole milliseconds, so a client that waits this long finds the time passed.
    """
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"a duration must be >= 0 seconds, got {seconds!r}")
    millis = math.ceil(seconds * 1000 - 1e-6)
    if millis <= 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole_s, frac_ms = divmod(rest, 1000)
    secs = f"{whole_s}" if frac_ms == 0 else f"{whole_s}.{frac_ms:03d}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
