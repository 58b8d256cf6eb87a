"""Formatting filters of the console's templates."""

from __future__ import annotations

from django import template

register = template.Library()

GIB = 1024**3


@register.filter
def gib(value: int | float | None) -> str:
    """Bytes as GiB with one decimal ("—" for None)."""
    if value is None:
        return "—"
    return f"{value / GIB:.1f} GiB"


@register.filter
def duration(seconds: float | None) -> str:
    """A duration in seconds as "2h 05m", "4m 10s" or "12s" ("—" for None)."""
    if seconds is None:
        return "—"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


@register.filter
def number(value: float | int | None, digits: int = 1) -> str:
    """A number with thousands separators and `digits` decimals ("—" for None)."""
    if value is None:
        return "—"
    return f"{value:,.{int(digits)}f}"


@register.filter
def fraction_pct(value: float | None) -> str:
    """A fraction 0..1 as a percentage with one decimal ("—" for None)."""
    if value is None:
        return "—"
    return f"{100.0 * value:.1f}%"
