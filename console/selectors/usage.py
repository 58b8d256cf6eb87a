"""A tenant's inference usage per model, as the tenant page's table shows it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from api.models import Tenant
from api.usage_selectors import UsageSum, usage_sums

DAY_S = 24 * 3600
MONTH_S = 30 * DAY_S


@dataclass(frozen=True)
class ModelUsage:
    """One model's calls by a tenant over the last 24 hours and the last 30 days."""

    model: str
    day: UsageSum | None
    month: UsageSum


def tenant_usage_by_model(*, tenant: Tenant, now: datetime) -> list[ModelUsage]:
    """Every model the tenant called in the last 30 days (up to `now`), busiest first."""
    end = int(now.timestamp()) + 1
    month = usage_sums(tenant=tenant, start=end - MONTH_S, end=end, width=None, by_model=True)
    day = {
        s.model: s
        for s in usage_sums(tenant=tenant, start=end - DAY_S, end=end, width=None, by_model=True)
    }
    rows = [ModelUsage(model=str(s.model), day=day.get(s.model), month=s) for s in month]
    return sorted(rows, key=lambda r: (-r.month.prompt_tokens - r.month.completion_tokens, r.model))
