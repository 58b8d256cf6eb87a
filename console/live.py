"""Live page parts: server-rendered HTML pieces a page refreshes in place.

A page marks each piece `<div data-part="NAME" data-version="...">` and names its live endpoint in
`<main data-live-url="...">`. The endpoint answers `{"parts": {NAME: {"html", "version"}}}`; the
browser swaps a piece only when its version (a digest of the HTML) changed, so an unchanged piece
is never touched. Parts hold no forms: a CSRF token renders differently each time, and a button
replaced under the operator's pointer would lose the click.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.template.loader import render_to_string
from django.utils.safestring import SafeString, mark_safe


@dataclass(frozen=True)
class Part:
    html: SafeString
    version: str


def render_parts(
    request: HttpRequest, templates: Mapping[str, str], context: Mapping[str, Any]
) -> dict[str, Part]:
    """Render each named template with `context`; the version is a digest of its HTML."""
    parts = {}
    for name, template in templates.items():
        html = render_to_string(template, dict(context), request=request)
        digest = hashlib.sha256(html.encode("utf-8")).hexdigest()[:16]
        # Rendered by our own templates, which escape every value: safe to insert as is.
        parts[name] = Part(html=mark_safe(html), version=digest)
    return parts


def parts_response(parts: Mapping[str, Part]) -> JsonResponse:
    response = JsonResponse(
        {"parts": {name: {"html": p.html, "version": p.version} for name, p in parts.items()}}
    )
    response["Cache-Control"] = "no-store"
    return response
