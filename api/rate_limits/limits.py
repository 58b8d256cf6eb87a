"""A tenant's per-minute limits, as the limiters take them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class HasLimits(Protocol):
    """Anything carrying the two limits (a `Tenant` row does)."""

    @property
    def requests_per_minute(self) -> int | None: ...

    @property
    def tokens_per_minute(self) -> int | None: ...


@dataclass(frozen=True)
class Limits:
    """Requests and tokens a tenant may use per minute; None is unlimited.

    Each limit is the capacity of a token bucket that refills continuously at limit/60 per
    second (see `api.rate_limits.bucket`).
    """

    requests_per_minute: int | None
    tokens_per_minute: int | None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    @classmethod
    def of(cls, tenant: HasLimits) -> Limits:
        """The limits stored on `tenant` (a `Tenant`, or anything with the two attributes)."""
        return cls(
            requests_per_minute=tenant.requests_per_minute,
            tokens_per_minute=tenant.tokens_per_minute,
        )

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None
