"""Inference usage: add aggregated counts to the per-minute rows, in batches."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Case, F, Value, When
from django.db.models.fields import PositiveBigIntegerField

from api.models import Tenant, TenantUsage

logger = logging.getLogger(__name__)

# Rows per statement: bounded so that a statement's parameters stay far below SQLite's limit
# (each row costs about seven in the UPDATE's CASE).
BATCH_ROWS = 200
COUNTS = ("requests", "prompt_tokens", "completion_tokens")


@dataclass(frozen=True)
class UsageRow:
    """Counts to add to one (tenant, model, minute); `minute` is an aware UTC datetime on a
    whole minute."""

    tenant_id: int
    model: str
    minute: datetime
    requests: int
    prompt_tokens: int
    completion_tokens: int

    def __post_init__(self) -> None:
        if not self.model or len(self.model) > 255:
            raise ValueError(f"model must be 1-255 characters, got {self.model!r}")
        if self.minute.tzinfo is None or self.minute.utcoffset() != timedelta(0):
            raise ValueError(f"minute must be an aware UTC datetime, got {self.minute!r}")
        if self.minute.second or self.minute.microsecond:
            raise ValueError(f"minute must be on a whole minute, got {self.minute.isoformat()}")
        for name in COUNTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def key(self) -> tuple[int, str, datetime]:
        return (self.tenant_id, self.model, self.minute)


@transaction.atomic
def usage_record_batch(*, rows: Sequence[UsageRow]) -> int:
    """Add `rows` to the usage table in one transaction; returns how many rows were written.

    Rows with the same key are summed first. Per batch of `BATCH_ROWS` keys: one INSERT of the
    missing rows (zero counts, conflicts ignored), one SELECT ... FOR UPDATE of all of them in
    id order, one UPDATE adding each row's counts (`F(count) + n`). Concurrent writers of the
    same keys therefore each add their counts: PostgreSQL orders them by the row locks, taken
    in one order everywhere; SQLite transactions begin IMMEDIATE (`config.database`) and run
    one at a time. Rows of a tenant that no longer exists are dropped (and logged): they would
    otherwise fail the whole batch for good.
    """
    merged: dict[tuple[int, str, datetime], list[int]] = {}
    for row in rows:
        counts = merged.setdefault(row.key, [0, 0, 0])
        for index, name in enumerate(COUNTS):
            counts[index] += getattr(row, name)
    if not merged:
        return 0
    known = set(
        Tenant.objects.filter(pk__in={key[0] for key in merged}).values_list("pk", flat=True)
    )
    dropped = sorted({key[0] for key in merged if key[0] not in known})
    if dropped:
        logger.warning("usage: dropping the rows of deleted tenants %s", dropped)
    keys = sorted(key for key in merged if key[0] in known)
    for start in range(0, len(keys), BATCH_ROWS):
        _add(keys[start : start + BATCH_ROWS], merged)
    return len(keys)


def _add(
    keys: list[tuple[int, str, datetime]], merged: dict[tuple[int, str, datetime], list[int]]
) -> None:
    TenantUsage.objects.bulk_create(
        [TenantUsage(tenant_id=t, model=m, minute=minute) for t, m, minute in keys],
        ignore_conflicts=True,
    )
    wanted = set(keys)
    candidates = (
        TenantUsage.objects.select_for_update()
        .filter(
            tenant_id__in={k[0] for k in keys},
            model__in={k[1] for k in keys},
            minute__in={k[2] for k in keys},
        )
        .order_by("pk")
        .values_list("pk", "tenant_id", "model", "minute")
    )
    ids = {(t, m, minute): pk for pk, t, m, minute in candidates if (t, m, minute) in wanted}
    missing = wanted - set(ids)
    if missing:  # the INSERT made every one of them; a miss is a bug, never silently lost
        raise RuntimeError(f"usage rows not found after insert: {sorted(missing)[:5]}")
    updates = {
        name: F(name)
        + Case(
            *[When(pk=ids[key], then=Value(merged[key][index])) for key in keys],
            default=Value(0),
            output_field=PositiveBigIntegerField(),
        )
        for index, name in enumerate(COUNTS)
    }
    TenantUsage.objects.filter(pk__in=list(ids.values())).update(**updates)
