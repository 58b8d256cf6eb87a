"""Helpers shared by the console's page views."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from console.selectors import DEFAULT_RANGE, RANGES

# How often pages refresh their charts and live parts; `HARLI_CONSOLE_REFRESH_MS` overrides.
DEFAULT_REFRESH_MS = 5000

NAV = (
    ("fleet", "Fleet", "console:fleet"),
    ("jobs", "Jobs", "console:jobs"),
    ("tenants", "Tenants & keys", "console:tenants"),
    ("models", "Base models", "console:models"),
    ("hosts", "Hosts", "console:hosts"),
    ("predictors", "Predictors", "console:predictors"),
)


def page_range(request: HttpRequest) -> tuple[str, timedelta, datetime]:
    """The page's time range name, its length and its start. An unknown name falls back to the
    default on pages (the chart endpoints reject it)."""
    name = request.GET.get("range") or DEFAULT_RANGE
    if name not in RANGES:
        name = DEFAULT_RANGE
    return name, RANGES[name], timezone.now() - RANGES[name]


def render_page(
    request: HttpRequest,
    template: str,
    context: dict[str, Any],
    *,
    section: str,
    status: int = 200,
    ranged: bool = False,
) -> HttpResponse:
    """Render a console page with the navigation, the active section and the range selector."""
    range_name = page_range(request)[0] if ranged else None
    full = {
        "nav": NAV,
        "section": section,
        "ranges": list(RANGES),
        "range_name": range_name,
        "refresh_ms": int(getattr(settings, "HARLI_CONSOLE_REFRESH_MS", DEFAULT_REFRESH_MS)),
        **context,
    }
    return render(request, template, full, status=status)


def not_found(request: HttpRequest, *, what: str, section: str) -> HttpResponse:
    return render_page(
        request, "console/not_found.html", {"what": what}, section=section, status=404
    )
