"""Gateway grants: the credential the control plane's gateway presents to a host per request.

The gateway authenticates the tenant's API key itself and decides which model the request may
use; the host then trusts only a grant, never the tenant's key (a host no longer asks the
control plane about keys, and a tenant calling a host directly reaches nothing).

A grant names the host it is for, the tenant, the model names it allows (the one the request
asked for), an expiry (Unix seconds) and the gateway's request id. It travels in the
:data:`GRANT_HEADER` header as ``v1.<payload>.<signature>``: the payload is the grant's compact
JSON in unpadded base64url, the signature HMAC-SHA256 of the payload's text under the host's
key, also unpadded base64url.

Each host has its own key, derived from the fleet's gateway secret (:func:`host_key`), so the
control plane needs only the one secret, and a host that leaks its key can forge grants for
itself alone. The operator gives each host its key (``manage.py hosts key NAME``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass

GRANT_HEADER = "x-harli-grant"
PROMPT_TOKENS_HEADER = "x-harli-prompt-tokens"
"""A host's completion responses name the request's prompt tokens here, so the gateway can
account a stream that is cut off before its usage chunk."""
GRANT_VERSION = "v1"
GRANT_TTL_S = 60.0
"""How long a grant the gateway signs stays valid: long enough for a request to queue and
start, short enough that a captured header is soon useless."""
CLOCK_LEEWAY_S = 5.0
"""How far apart the gateway's and a host's clocks may be."""
MAX_GRANT_CHARS = 8192

_KEY_LABEL = b"harli-host-grant-key\x00"


class GrantError(ValueError):
    """A grant that is malformed, signed with another key, for another host, or expired."""


@dataclass(frozen=True)
class Grant:
    host: str
    tenant: str
    """The tenant's name (it appears in the host's logs and metrics)."""
    models: tuple[str, ...]
    """The model names the request may use (base model, adapter or checkpoint names)."""
    expires_at: float
    """Unix seconds."""
    request_id: str = ""
    """The gateway's id of the request, for logs on both sides."""

    def allows(self, model: str) -> bool:
        return model in self.models


def host_key(secret: str, host: str) -> str:
    """The hex key of `host` derived from the fleet's gateway `secret`."""
    if not secret:
        raise ValueError("the gateway secret is empty")
    return hmac.new(secret.encode(), _KEY_LABEL + host.encode(), hashlib.sha256).hexdigest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(key: str, payload: str) -> str:
    return _b64(hmac.new(key.encode(), payload.encode("ascii"), hashlib.sha256).digest())


def grant_sign(grant: Grant, key: str) -> str:
    """The header value carrying `grant`, signed with the host's `key`."""
    body = {
        "h": grant.host,
        "t": grant.tenant,
        "m": list(grant.models),
        "exp": round(grant.expires_at, 3),
        "rid": grant.request_id,
    }
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    return f"{GRANT_VERSION}.{payload}.{_signature(key, payload)}"


def grant_verify(token: str, key: str, *, host: str, now: float) -> Grant:
    """The grant `token` carries, checked against `key`, this `host` and the time `now`
    (Unix seconds); GrantError saying why otherwise."""
    if not token or len(token) > MAX_GRANT_CHARS:
        raise GrantError("missing or oversized grant")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != GRANT_VERSION:
        raise GrantError("malformed grant")
    _, payload, signature = parts
    try:
        expected = _signature(key, payload)
    except UnicodeEncodeError:
        raise GrantError("malformed grant") from None
    if not hmac.compare_digest(expected.encode(), signature.encode("ascii", "replace")):
        raise GrantError("bad grant signature")
    try:
        body = json.loads(_unb64(payload))
        grant = Grant(
            host=str(body["h"]),
            tenant=str(body["t"]),
            models=tuple(str(m) for m in body["m"]),
            expires_at=float(body["exp"]),
            request_id=str(body.get("rid", "")),
        )
    except (binascii.Error, ValueError, KeyError, TypeError) as exc:
        raise GrantError(f"malformed grant payload: {exc}") from None
    if grant.host != host:
        raise GrantError(f"the grant is for host {grant.host!r}, not {host!r}")
    if grant.expires_at + CLOCK_LEEWAY_S < now:
        raise GrantError("the grant has expired")
    return grant
