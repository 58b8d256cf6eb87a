"""Sign-in and sign-out of the console."""

from __future__ import annotations

import logging
import math
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from api.login_throttle import (
    Lockout,
    LoginThrottlePolicy,
    login_ip,
    login_lockout_get,
    login_username,
)
from api.services.login_failures import login_attempt_begin, login_failures_clear
from console.access import OperatorLoginForm
from console.client_ip import client_ip

logger = logging.getLogger(__name__)


def lockout_message(lockout: Lockout, *, now: datetime) -> str:
    """What the login page says while a lockout holds (whole minutes, rounded up)."""
    minutes = max(1, math.ceil(lockout.remaining(now=now).total_seconds() / 60))
    unit = "minute" if minutes == 1 else "minutes"
    return f"Too many failed sign-ins; try again in {minutes} {unit}."


class ConsoleLoginView(auth_views.LoginView):
    """Django's login view with the operator-only form and the login throttle; a signed-in
    operator goes to the fleet.

    A sign-in for a locked-out username (at this address, or everywhere), or from a locked-out
    address (`api.login_throttle`), is answered 429 with the login page and its message, before
    the password is checked. Every other sign-in with a username is counted as a failure before
    its password is checked, and the one that reaches a limit is answered 429 already; a
    successful one clears the username's failures from its address. Refusals are
    logged at WARNING with the username and the address, never the password.
    """

    template_name = "console/login.html"
    authentication_form = OperatorLoginForm
    redirect_authenticated_user = True
    next_page = "console:fleet"

    throttle_policy: LoginThrottlePolicy
    throttle_username: str
    """The submitted username's key in the throttle (`login_username`)."""
    throttle_ip: str

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        self.throttle_policy = LoginThrottlePolicy.from_settings()
        self.throttle_username = login_username(str(request.POST.get("username", "")))
        self.throttle_ip = login_ip(
            client_ip(request, trusted_proxy_hops=settings.HARLI_TRUSTED_PROXY_HOPS)
        )
        if not self.throttle_username:  # nothing will be checked: nothing to count
            return super().post(request, *args, **kwargs)
        now = timezone.now()
        # Counted before the password is checked (a failure until it proves right), so a
        # burst of simultaneous attempts cannot all pass the check.
        admitted = login_attempt_begin(
            username=self.throttle_username,
            ip=self.throttle_ip,
            at=now,
            policy=self.throttle_policy,
        )
        if isinstance(admitted, Lockout):
            return self.locked_out(admitted, now=now)
        return super().post(request, *args, **kwargs)

    def form_valid(self, form: Any) -> HttpResponse:
        if self.throttle_username:
            login_failures_clear(username=self.throttle_username, ip=self.throttle_ip)
        return super().form_valid(form)

    def form_invalid(self, form: Any) -> HttpResponse:
        if not self.throttle_username:  # nothing was checked
            return super().form_invalid(form)
        # The attempt's failure is recorded already; the one that reached a limit says so.
        refusal = self.refusal_if_locked(timezone.now())
        return refusal if refusal is not None else super().form_invalid(form)

    def refusal_if_locked(self, now: datetime) -> HttpResponse | None:
        """The lockout page when this username or address is locked out at `now`, else None."""
        lockout = login_lockout_get(
            username=self.throttle_username,
            ip=self.throttle_ip,
            policy=self.throttle_policy,
            now=now,
        )
        return self.locked_out(lockout, now=now) if lockout is not None else None

    def locked_out(self, lockout: Lockout, *, now: datetime) -> HttpResponse:
        """The login page, unbound (a bound form would check the password), with the
        lockout's message: 429 with Retry-After."""
        remaining_s = math.ceil(lockout.remaining(now=now).total_seconds())
        logger.warning(
            "console sign-in refused: too many failed sign-ins (%s locked out) for username "
            "%r from %s; %d s left",
            lockout.scope,
            self.throttle_username,
            self.throttle_ip or "an unknown address",
            remaining_s,
        )
        submitted = str(self.request.POST.get("username", ""))
        form = self.get_form_class()(self.request, initial={"username": submitted})
        message = lockout_message(lockout, now=now)
        response = self.render_to_response(
            self.get_context_data(form=form, lockout_message=message), status=429
        )
        response["Retry-After"] = str(max(1, remaining_s))
        return response


class ConsoleLogoutView(auth_views.LogoutView):
    """Sign out (POST only, with the CSRF token) and return to the login page."""

    next_page = "console:login"
