"""Sign-in and sign-out of the console."""

from __future__ import annotations

from django.contrib.auth import views as auth_views

from console.access import OperatorLoginForm


class ConsoleLoginView(auth_views.LoginView):
    """Django's login view with the operator-only form; a signed-in operator goes to the fleet."""

    template_name = "console/login.html"
    authentication_form = OperatorLoginForm
    redirect_authenticated_user = True
    next_page = "console:fleet"


class ConsoleLogoutView(auth_views.LogoutView):
    """Sign out (POST only, with the CSRF token) and return to the login page."""

    next_page = "console:login"
