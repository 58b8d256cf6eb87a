"""Formatting filters of the console's templates."""

from __future__ import annotations

from typing import TypeGuard

from django import template

register = template.Library()

GIB = 1024**3
MISSING = "—"


def _is_number(value: object) -> TypeGuard[int | float]:
    """Templates pass "" for a missing attribute (e.g. of a host with no metrics yet)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@register.filter
def gib(value: object) -> str:
    """Bytes as GiB with one decimal ("—" for anything but a number)."""
    if not _is_number(value):
        return MISSING
    return f"{value / GIB:.1f} GiB"


@register.filter
def duration(seconds: object) -> str:
    """A duration in seconds as "2h 05m", "4m 10s" or "12s" ("—" for anything but a number)."""
    if not _is_number(seconds):
        return MISSING
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


@register.filter
def number(value: object, digits: int = 1) -> str:
    """A number with thousands separators and `digits` decimals ("—" for anything else)."""
    if not _is_number(value):
        return MISSING
    return f"{value:,.{int(digits)}f}"


@register.filter
def fraction_pct(value: object) -> str:
    """A fraction 0..1 as a percentage with one decimal ("—" for anything but a number)."""
    if not _is_number(value):
        return MISSING
    return f"{100.0 * value:.1f}%"


@register.simple_tag
def job_setting(job: object, name: str) -> str:
    """A job's training setting `name` as a host ran it: the value the tenant gave, or, for
    "auto", what the job's host resolved it to ("1.0 (auto)"; "auto" until a host starts it).
    A DPO job's `beta` is `dpo_beta`."""
    requested = getattr(job, "hyperparameters", None) or {}
    value = getattr(job, "dpo_beta", None) if name == "beta" else requested.get(name)
    resolved = (getattr(job, "resolved_hyperparameters", None) or {}).get(name)
    if value == "auto":
        return "auto" if resolved is None else f"{resolved} (auto)"
    return MISSING if value is None else str(value)
