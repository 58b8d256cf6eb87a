"""OpenAI-style cursor paging: `?after=<id>&limit=N` over a newest-first list.

The response is `{"object": "list", "data": [...], "has_more": bool}` (plus `first_id` and
`last_id`); the client passes the last id it saw as `after` to get the next page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.db import models
from django.db.models import Q

from api.errors import HarliError

DEFAULT_LIMIT = 20
MAX_LIMIT = 100

M = TypeVar("M", bound=models.Model)


@dataclass(frozen=True)
class Page(Generic[M]):
    items: list[M]
    has_more: bool


def parse_limit(raw: str | None, *, default: int = DEFAULT_LIMIT) -> int:
    if raw is None or raw == "":
        return default
    try:
        limit = int(raw)
    except ValueError:
        raise HarliError(f"limit must be an integer, got {raw!r}.", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise HarliError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}.", param="limit")
    return limit


def cursor_page(
    queryset: models.QuerySet[M], *, after: str | None, limit: int, order: tuple[str, str]
) -> Page[M]:
    """Return up to `limit` rows of `queryset` ordered by the two descending fields `order`
    (e.g. `("created_at", "id")`), starting after the row whose pk is `after`.

    `after` is looked up inside `queryset`, so a row outside it (another tenant's) is unknown.
    """
    first, second = order
    ordered = queryset.order_by(f"-{first}", f"-{second}")
    if after:
        anchor = ordered.filter(pk=after).values(first, second).first()
        if anchor is None:
            raise HarliError(f"No object with id {after!r} to page after.", param="after")
        ordered = ordered.filter(
            Q(**{f"{first}__lt": anchor[first]})
            | Q(**{first: anchor[first], f"{second}__lt": anchor[second]})
        )
    rows = list(ordered[: limit + 1])
    return Page(items=rows[:limit], has_more=len(rows) > limit)


def page_body(page: Page[Any], data: list[Any]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "has_more": page.has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
