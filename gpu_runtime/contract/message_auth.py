"""Host messages signed per host: every report a host sends and every command it is sent.

A message (the payload dict of `gpu_runtime.contract.protocol`) carries
``"signature": "v1.<hex>"``, HMAC-SHA256 over its canonical JSON without that field: keys
sorted, no whitespace, ASCII. The payload includes its id (`message_id` of a report,
`command_id` of a command) and a report its `host`, so a signature covers them: a replayed
report is the same message id, which the control plane applies once (`ProcessedReport`), and a
report cannot be moved to another host's name.

The key is the host's message key, derived from its host key (:func:`message_key`; the host
key is `gpu_runtime.contract.grants.host_key` of the fleet's gateway secret and the host's
name, which the operator already gives each agent as `HARLI_HOST_KEY`). The control plane
derives the same key from the secret, so no new secret is stored or handed out, and a leaked
host key lets one forge that host's messages only (docs/decisions/0022-host-message-keys.md).

Signing happens when a message is built, before it is queued or stored, so a message kept in
an outbox and sent later still verifies. Neither Django nor torch is imported here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIGNATURE_FIELD = "signature"
SIGNATURE_VERSION = "v1"
_MESSAGE_KEY_LABEL = b"harli-host-message-key\x00"
_HEX_DIGEST_CHARS = 64


class MessageAuthError(ValueError):
    """A message without a signature, with a malformed one, or signed with another key."""


def message_key(host_key: str) -> bytes:
    """The key a host's messages are signed with, derived from its (hex) host key. A different
    label than the grants' own derivation: a grant's signature never verifies as a message's."""
    if not host_key:
        raise ValueError("the host key is empty")
    return hmac.new(host_key.encode("ascii"), _MESSAGE_KEY_LABEL, hashlib.sha256).digest()


def canonical_payload(message: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the message without its signature, as canonical JSON."""
    body = {k: v for k, v in message.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _digest(key: bytes, message: dict[str, Any]) -> str:
    return hmac.new(key, canonical_payload(message), hashlib.sha256).hexdigest()


def message_sign(message: dict[str, Any], key: bytes) -> dict[str, Any]:
    """A copy of `message` with its signature under `key` (a previous signature replaced)."""
    signed = {k: v for k, v in message.items() if k != SIGNATURE_FIELD}
    signed[SIGNATURE_FIELD] = f"{SIGNATURE_VERSION}.{_digest(key, signed)}"
    return signed


def message_verify(message: Any, key: bytes) -> dict[str, Any]:
    """`message` without its signature when the signature is `key`'s over it, else
    MessageAuthError naming what is wrong (never the expected signature)."""
    if not isinstance(message, dict):
        raise MessageAuthError(f"a signed message is a JSON object, got {type(message).__name__}")
    signature = message.get(SIGNATURE_FIELD)
    if signature is None:
        raise MessageAuthError("unsigned message")
    if not isinstance(signature, str):
        raise MessageAuthError("malformed signature")
    version, dot, digest = signature.partition(".")
    if version != SIGNATURE_VERSION or not dot or len(digest) != _HEX_DIGEST_CHARS:
        raise MessageAuthError(f"malformed signature (expected {SIGNATURE_VERSION}.<hex>)")
    body = {k: v for k, v in message.items() if k != SIGNATURE_FIELD}
    try:
        expected = _digest(key, body)
    except (TypeError, ValueError) as exc:  # a payload that is not plain JSON data
        raise MessageAuthError(f"payload cannot be canonicalised: {exc}") from exc
    if not hmac.compare_digest(expected, digest):
        raise MessageAuthError("bad signature (altered, or signed with another key)")
    return body
