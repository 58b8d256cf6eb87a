"""Failed sign-ins to the console: count an attempt before its password is checked, clear a
username's failures from an address on success (the rules they feed are in
`api.login_throttle`)."""

from __future__ import annotations

from datetime import datetime

from django.db import connection, transaction

from api.login_throttle import Lockout, LoginThrottlePolicy, login_lockout_get
from api.models import LoginFailure

# The PostgreSQL advisory lock that serializes the throttle's check-and-count (SQLite's write
# transactions are serialized already): an arbitrary constant, the bytes of "harli-lg".
_ADVISORY_KEY = int.from_bytes(b"harli-lg", "big") >> 1


def _serialize() -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_ADVISORY_KEY])


@transaction.atomic
def login_attempt_begin(
    *, username: str, ip: str, at: datetime, policy: LoginThrottlePolicy
) -> Lockout | LoginFailure:
    """Admit one sign-in attempt for `username` from `ip` at `at`, before its password is
    checked: the lockout that refuses it, or the failure row that counts it (deleted by
    `login_failures_clear` if the password is right). The check and the insert run under one
    lock, so simultaneous attempts are counted one after another. Deletes every failure older
    than the policy's lookback."""
    _serialize()
    lockout = login_lockout_get(username=username, ip=ip, policy=policy, now=at)
    if lockout is not None:
        return lockout
    LoginFailure.objects.filter(at__lte=at - policy.lookback).delete()
    return LoginFailure.objects.create(username=username, ip=ip, at=at)


@transaction.atomic
def login_failures_clear(*, username: str, ip: str) -> int:
    """Delete `username`'s failures from `ip` (after it signed in from there); returns how many
    there were. Failures from other addresses stay: they count towards the username's global
    limit and the other addresses' lockouts."""
    deleted, _ = LoginFailure.objects.filter(username=username, ip=ip).delete()
    return deleted
