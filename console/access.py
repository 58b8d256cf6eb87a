"""Who may use the console: signed-in operators, by Django session, and no one else.

Every console view derives from `OperatorView` (pages) or `OperatorJsonView` (chart data), whose
`dispatch` checks the user before any handler runs; a subclass cannot skip the check without
overriding `dispatch` itself. API keys are never read here: an `Authorization: Bearer` header
from a tenant (or anyone) is ignored, so it opens nothing. Failures are closed:
- not signed in: pages redirect to the login page, JSON answers 401;
- signed in but not an operator (a tenant's user): 403.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views import View

from api.errors import error_body
from api.models import User, UserRole


def is_operator(user: object) -> bool:
    """An active, signed-in user with the operator role."""
    return (
        isinstance(user, User)
        and user.is_authenticated
        and user.is_active
        and user.role == UserRole.OPERATOR
    )


class OperatorLoginForm(AuthenticationForm):
    """Django's login form, refusing every account that is not an operator."""

    error_messages = {
        **AuthenticationForm.error_messages,
        "not_operator": "This account is not an operator; the console is for operators only.",
    }

    def confirm_login_allowed(self, user: Any) -> None:
        super().confirm_login_allowed(user)
        if not is_operator(user):
            raise forms.ValidationError(self.error_messages["not_operator"], code="not_operator")


class OperatorView(View):
    """Base of every console page: operators only (see the module docstring)."""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        user = request.user
        if not user.is_authenticated:
            return redirect_to_login(request.get_full_path(), reverse("console:login"))
        if not is_operator(user):
            return render(request, "console/forbidden.html", status=403)
        return super().dispatch(request, *args, **kwargs)


class OperatorJsonView(View):
    """Base of every console JSON endpoint: operators only, errors as JSON in the API's shape."""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        user = request.user
        if not user.is_authenticated:
            return JsonResponse(
                error_body("Sign in to the console first.", type_="authentication_error"),
                status=401,
            )
        if not is_operator(user):
            return JsonResponse(
                error_body("The console is for operators only.", type_="permission_error"),
                status=403,
            )
        return super().dispatch(request, *args, **kwargs)
