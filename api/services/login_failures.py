"""Failed sign-ins to the console: record them, clear a username's on success (the rules
they feed are in `api.login_throttle`)."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from api.login_throttle import LoginThrottlePolicy
from api.models import LoginFailure


@transaction.atomic
def login_failure_record(
    *, username: str, ip: str, at: datetime, policy: LoginThrottlePolicy
) -> LoginFailure:
    """Record a refused sign-in for `username` from `ip` at `at` (keys as in
    `api.login_throttle`), and delete every failure older than the policy's lookback."""
    LoginFailure.objects.filter(at__lte=at - policy.lookback).delete()
    return LoginFailure.objects.create(username=username, ip=ip, at=at)


@transaction.atomic
def login_failures_clear(*, username: str) -> int:
    """Delete `username`'s failures (after it signed in); returns how many there were."""
    deleted, _ = LoginFailure.objects.filter(username=username).delete()
    return deleted
