"""Who may call what: operators (/api/ops/) and tenant users (/v1)."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from api.models import Tenant, User, UserRole


def request_tenant(request: Request) -> Tenant | None:
    """The tenant the request acts for, or None (anonymous, operator, or a user with no tenant)."""
    user = request.user
    if not isinstance(user, User) or not user.is_active or user.role != UserRole.TENANT:
        return None
    return user.tenant


class IsOperator(BasePermission):
    """An active user with the operator role (session or the operator's API key)."""

    message = "This endpoint needs an operator."

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        return isinstance(user, User) and user.is_active and user.role == UserRole.OPERATOR


class IsTenantUser(BasePermission):
    """An active user acting for a tenant (a tenant API key)."""

    message = "This endpoint needs a tenant API key."

    def has_permission(self, request: Request, view: Any) -> bool:
        return request_tenant(request) is not None
