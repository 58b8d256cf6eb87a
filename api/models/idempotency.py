"""Idempotency keys of the tenant API: a write retried with the same `Idempotency-Key` header
is done once, and its first response is answered again (`api.idempotency`).

A row is claimed (inserted, `response_status` null) before the request's work starts, and
completed (the response stored) in the same transaction as the work's writes, so the two
commit together or not at all. `claim` names the request that holds the row; the completion is
conditional on it, so of two requests that both believe they hold a key, one rolls back.
Rows expire `HARLI_IDEMPOTENCY_KEY_RETENTION_H` after their creation; the janitor deletes them.
"""

from __future__ import annotations

from django.db import models

from api.models.tenancy import Tenant

IDEMPOTENCY_KEY_MAX_LENGTH = 255


class IdempotencyKey(models.Model):
    """One tenant's use of one key: the request it was first sent with (`fingerprint`, a
    SHA-256 of method, path and body) and, once that request succeeded, its response."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="idempotency_keys")
    key = models.CharField(max_length=IDEMPOTENCY_KEY_MAX_LENGTH)
    method = models.CharField(max_length=8)
    path = models.TextField()
    fingerprint = models.CharField(max_length=64)
    claim = models.CharField(max_length=32)
    claimed_at = models.DateTimeField()
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    """Null while the first request is in flight."""
    response_body = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "key"], name="idempotency_key_per_tenant")
        ]
        indexes = [models.Index(fields=["expires_at"], name="idempotency_key_expires_at")]

    def __str__(self) -> str:
        return f"{self.tenant_id}:{self.key}"
