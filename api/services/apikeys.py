"""API keys: issued once in clear, stored as a SHA-256 digest, found by their visible prefix."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from api.errors import HarliError, NotFoundError
from api.models import ApiKey, Tenant, User
from api.models.ids import random_token
from api.services.tenants import tenant_service_user

KEY_SCHEME = "hk-"
PREFIX_LENGTH = len(KEY_SCHEME) + 8
SECRET_LENGTH = 40
# last_used_at is refreshed at most this often, so authentication rarely writes.
LAST_USED_RESOLUTION = timedelta(seconds=60)


@dataclass(frozen=True)
class IssuedKey:
    """The stored row and the clear key, which exists only here and is never stored."""

    api_key: ApiKey
    key: str


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@transaction.atomic
def api_key_issue(*, user: User, name: str = "") -> IssuedKey:
    """Create a key for `user` (a tenant's service user or an operator)."""
    for _ in range(5):
        key = KEY_SCHEME + random_token(SECRET_LENGTH)
        prefix = key[:PREFIX_LENGTH]
        if not ApiKey.objects.filter(prefix=prefix).exists():
            api_key = ApiKey.objects.create(
                user=user, name=name, prefix=prefix, digest=_digest(key)
            )
            return IssuedKey(api_key=api_key, key=key)
    raise HarliError("Could not find a free key prefix; try again.", code="key_prefix_exhausted")


def api_key_issue_for_tenant(*, tenant: Tenant, name: str = "") -> IssuedKey:
    return api_key_issue(user=tenant_service_user(tenant=tenant), name=name)


@transaction.atomic
def api_key_revoke(*, prefix_or_id: str) -> ApiKey:
    """Revoke a key given its prefix or numeric id. Revoking twice is harmless."""
    query = ApiKey.objects.select_for_update()
    if prefix_or_id.isdigit():
        api_key = query.filter(pk=int(prefix_or_id)).first()
    else:
        api_key = query.filter(prefix=prefix_or_id).first()
    if api_key is None:
        raise NotFoundError(f"No API key with prefix or id {prefix_or_id!r}.", param="key")
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


def api_key_authenticate(*, key: str) -> ApiKey | None:
    """Return the active key matching `key` (and refresh last_used_at), or None."""
    if not key.startswith(KEY_SCHEME) or len(key) != len(KEY_SCHEME) + SECRET_LENGTH:
        return None
    api_key = (
        ApiKey.objects.select_related("user", "user__tenant")
        .filter(prefix=key[:PREFIX_LENGTH], revoked_at__isnull=True)
        .first()
    )
    if api_key is None or not hmac.compare_digest(api_key.digest, _digest(key)):
        return None
    if not api_key.user.is_active:
        return None
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at >= LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now
    return api_key
