"""Tenants and the users that act for them; operators."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, transaction

from api.errors import ConflictError, HarliError
from api.models import Tenant, User, UserRole

SERVICE_USER_PREFIX = "tenant."


def tenant_service_username(tenant_name: str) -> str:
    """The username of the service user that owns a tenant's API keys."""
    return f"{SERVICE_USER_PREFIX}{tenant_name}"


@transaction.atomic
def tenant_create(*, name: str) -> Tenant:
    """Create a tenant and its service user. Raises HarliError on a bad or taken name."""
    tenant = Tenant(name=name)
    try:
        tenant.full_clean()
    except DjangoValidationError as exc:
        message = "; ".join(exc.message_dict.get("name", exc.messages))
        if Tenant.objects.filter(name=name).exists():
            raise ConflictError(
                f"A tenant named {name!r} already exists.", code="tenant_exists", param="name"
            ) from None
        raise HarliError(f"Invalid tenant name {name!r}: {message}", param="name") from None
    tenant.save()
    service_user = User(username=tenant_service_username(name), role=UserRole.TENANT, tenant=tenant)
    service_user.set_unusable_password()
    service_user.save()
    return tenant


def tenant_service_user(*, tenant: Tenant) -> User:
    """The tenant's service user (created with the tenant)."""
    return User.objects.get(username=tenant_service_username(tenant.name), tenant=tenant)


@transaction.atomic
def operator_create(*, username: str, password: str, email: str = "") -> User:
    """Create an operator who can sign in to the console and call /api/ops/."""
    if not username or username.startswith(SERVICE_USER_PREFIX):
        raise HarliError(
            f"Invalid operator username {username!r} (must be non-empty and not start with "
            f"{SERVICE_USER_PREFIX!r}).",
            param="username",
        )
    if not password:
        raise HarliError("An operator needs a non-empty password.", param="password")
    user = User(username=username, email=email, role=UserRole.OPERATOR, is_staff=True)
    try:
        user.full_clean(exclude=["password"])
    except DjangoValidationError as exc:
        if User.objects.filter(username=username).exists():
            raise ConflictError(
                f"A user named {username!r} already exists.", code="user_exists", param="username"
            ) from None
        raise HarliError(f"Invalid operator: {'; '.join(exc.messages)}", param="username") from None
    user.set_password(password)
    try:
        with transaction.atomic():
            user.save()
    except IntegrityError:
        raise ConflictError(
            f"A user named {username!r} already exists.", code="user_exists", param="username"
        ) from None
    return user


# The largest limit a PositiveIntegerField holds on every database.
MAX_RATE_LIMIT = 2**31 - 1


@transaction.atomic
def tenant_limits_set(
    *, tenant: Tenant, requests_per_minute: int | None, tokens_per_minute: int | None
) -> Tenant:
    """Set the tenant's requests-per-minute and tokens-per-minute limits (None: unlimited).

    Each must be an integer from 1 to MAX_RATE_LIMIT, or None; anything else raises
    HarliError naming the field, and nothing is written. The gateway applies a new limit to
    the tenant's next request (`api.rate_limits`).
    """
    for name, value in (
        ("requests_per_minute", requests_per_minute),
        ("tokens_per_minute", tokens_per_minute),
    ):
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_RATE_LIMIT
        ):
            raise HarliError(
                f"{name} must be an integer from 1 to {MAX_RATE_LIMIT}, or null for no limit; "
                f"got {value!r}.",
                param=name,
                code="invalid_value",
            )
    tenant.requests_per_minute = requests_per_minute
    tenant.tokens_per_minute = tokens_per_minute
    tenant.save(update_fields=["requests_per_minute", "tokens_per_minute"])
    return tenant
