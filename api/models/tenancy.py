"""Who calls the platform: tenants, their users and operators, and API keys."""

from __future__ import annotations

from django.contrib.auth.models import AbstractUser
from django.core.validators import RegexValidator
from django.db import models

# A tenant name appears inside fine-tuned model names (`ft:<base>:<tenant>:<suffix>:<id>`),
# so it must not contain ':'; lower-case slugs keep names unambiguous.
TENANT_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
tenant_name_validator = RegexValidator(
    TENANT_NAME_PATTERN,
    "a tenant name is 1-63 of a-z, 0-9 and '-', starting with a letter or digit",
)


class Tenant(models.Model):
    """A customer of the platform. Every file, job and adapter belongs to exactly one tenant.

    `requests_per_minute` and `tokens_per_minute` limit its inference calls through the gateway
    (`api.rate_limits`); null is unlimited. Set them with `tenant_limits_set`.
    """

    name = models.CharField(max_length=63, unique=True, validators=[tenant_name_validator])
    created_at = models.DateTimeField(auto_now_add=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                name="tenant_limits_positive",
                condition=(
                    models.Q(requests_per_minute__isnull=True) | models.Q(requests_per_minute__gt=0)
                )
                & (models.Q(tokens_per_minute__isnull=True) | models.Q(tokens_per_minute__gt=0)),
            )
        ]

    def __str__(self) -> str:
        return self.name


class UserRole(models.TextChoices):
    OPERATOR = "operator", "Operator"
    TENANT = "tenant", "Tenant"


class User(AbstractUser):
    """A principal. Operators run the platform; tenant users act only inside their tenant.

    Invariant (a database constraint): `role == tenant` exactly when `tenant` is set.
    Each tenant gets a service user `tenant.<name>` at creation; tenant API keys belong to it.
    """

    role = models.CharField(max_length=16, choices=UserRole.choices)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="users"
    )

    class Meta:
        constraints = [
            models.CheckConstraint(
                name="user_role_matches_tenant",
                condition=(
                    models.Q(role=UserRole.TENANT, tenant__isnull=False)
                    | models.Q(role=UserRole.OPERATOR, tenant__isnull=True)
                ),
            )
        ]

    @property
    def is_operator(self) -> bool:
        return self.role == UserRole.OPERATOR


class ApiKey(models.Model):
    """A bearer credential. Only a SHA-256 digest of the secret is stored; the secret is shown once.

    `prefix` is the first characters of the key (e.g. `hk-ab12cd34`), unique, safe to display, and
    used to find the row before comparing digests.
    """

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True)
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.prefix

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None
