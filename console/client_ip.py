"""The client address of a request, for the login throttle."""

from __future__ import annotations

import ipaddress

from django.http import HttpRequest


def _valid_ip(raw: str) -> str | None:
    try:
        return str(ipaddress.ip_address(raw.strip()))
    except ValueError:
        return None


def client_ip(request: HttpRequest, *, trusted_proxy_hops: int) -> str:
    """The client's address: REMOTE_ADDR, unless `trusted_proxy_hops` (n > 0) proxies are
    trusted to append the address they received from to X-Forwarded-For, in which case the
    n-th entry from the header's end. Entries further left were written by the client and are
    never trusted. A header with fewer than n entries, or an entry that is not an address,
    falls back to REMOTE_ADDR; "" when that is missing too."""
    remote = _valid_ip(request.META.get("REMOTE_ADDR", "")) or ""
    if trusted_proxy_hops <= 0:
        return remote
    entries = request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
    if len(entries) < trusted_proxy_hops:
        return remote
    return _valid_ip(entries[-trusted_proxy_hops]) or remote
