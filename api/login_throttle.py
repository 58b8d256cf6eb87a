"""Login throttling: when failed sign-ins lock a username at an address, an address, or a
username everywhere out.

The rule: once `max_failures_per_user` failed sign-ins for one username from one client address
fall within `window` of each other, further sign-ins for that username from that address are
refused for `lockout` after the failure that reached the limit, without the password being
checked; likewise `max_failures_per_ip` from one address (any usernames) lock the address, and
`max_failures_per_user_global` for one username from any addresses within `global_window` (a
slower limit, against a guesser spread over many addresses) lock the username everywhere. So an
attacker's failures lock the attacker's address out, not the operator signing in from
elsewhere. Refused attempts are not failures (nothing was checked), so a lockout does not
extend itself; a failure after it ends counts with the earlier ones still inside the window.
A successful sign-in deletes its username's failures from its address
(`api.services.login_failures.login_failures_clear`).

Failures live in the database (`LoginFailure`), so every web process sees the same counts. An
attempt is counted before its password is checked (`login_attempt_begin`: the check and the
insert of its failure row are one serialized transaction, the row deleted again on success),
so a burst of simultaneous attempts gets at most the limit's number of passwords checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from django.conf import settings

from api.models import LoginFailure
from api.models.login import IP_MAX_LENGTH

USERNAME_MAX_LENGTH = LoginFailure._meta.get_field("username").max_length or 150


def login_username(raw: str) -> str:
    """The key a submitted username is counted under: stripped, case-folded (so "OPS" and
    "ops" share one count), cut to the column's length."""
    return raw.strip().casefold()[:USERNAME_MAX_LENGTH]


def login_ip(raw: str) -> str:
    """The key a client address is counted under ("" when unknown)."""
    return raw.strip()[:IP_MAX_LENGTH]


@dataclass(frozen=True)
class LoginThrottlePolicy:
    """The limits of the login throttle (settings `HARLI_LOGIN_*`)."""

    max_failures_per_user: int
    """Failed sign-ins for one username from one client address, within `window`, that lock
    that username out at that address."""
    max_failures_per_ip: int
    """Failed sign-ins from one client address (any usernames), within `window`, that lock
    it out."""
    window: timedelta
    """How close together the failures must be to count towards one lockout."""
    lockout: timedelta
    """How long a lockout lasts, from the failure that reached the limit."""
    max_failures_per_user_global: int = 100
    """Failed sign-ins for one username from any addresses, within `global_window`, that lock
    the username out everywhere."""
    global_window: timedelta = timedelta(hours=1)
    """How close together the failures must be to count towards a username's global lockout."""

    def __post_init__(self) -> None:
        for name in (
            "max_failures_per_user",
            "max_failures_per_ip",
            "max_failures_per_user_global",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("window", "lockout", "global_window"):
            value = getattr(self, name)
            if value <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {value}")

    @property
    def lookback(self) -> timedelta:
        """How far back a failure can still matter: the first of a run of failures is at most
        `window` before the last, whose lockout ends `lockout` after it."""
        return max(self.window, self.global_window) + self.lockout

    @classmethod
    def from_settings(cls) -> LoginThrottlePolicy:
        return cls(
            max_failures_per_user=settings.HARLI_LOGIN_MAX_FAILURES_PER_USER,
            max_failures_per_ip=settings.HARLI_LOGIN_MAX_FAILURES_PER_IP,
            window=timedelta(seconds=settings.HARLI_LOGIN_WINDOW_S),
            lockout=timedelta(seconds=settings.HARLI_LOGIN_LOCKOUT_S),
            max_failures_per_user_global=settings.HARLI_LOGIN_MAX_FAILURES_PER_USER_GLOBAL,
            global_window=timedelta(seconds=settings.HARLI_LOGIN_GLOBAL_WINDOW_S),
        )


LockoutScope = Literal["username+ip", "ip", "username"]


@dataclass(frozen=True)
class Lockout:
    """A lockout in force: what it holds (`username+ip`: the username at this address, `ip`:
    the address, `username`: the username everywhere) and when it ends."""

    scope: LockoutScope
    until: datetime

    def remaining(self, *, now: datetime) -> timedelta:
        return max(self.until - now, timedelta(0))


def lockout_end(
    *, failures: Sequence[datetime], limit: int, window: timedelta, lockout: timedelta
) -> datetime | None:
    """When the latest lockout earned by `failures` (ascending) ends: `lockout` after the
    latest failure that is the `limit`-th within `window` (None when no run reaches it)."""
    for last in range(len(failures) - 1, limit - 2, -1):
        if failures[last] - failures[last - limit + 1] <= window:
            return failures[last] + lockout
    return None


def login_lockout_get(
    *, username: str, ip: str, policy: LoginThrottlePolicy, now: datetime
) -> Lockout | None:
    """The lockout that refuses a sign-in for `username` from `ip` at `now` (the one that
    ends last when several apply), or None. `username` and `ip` are keys (`login_username`,
    `login_ip`); an empty one is not counted."""
    since = now - policy.lookback
    found: list[Lockout] = []
    scopes: tuple[tuple[LockoutScope, dict[str, str], int, timedelta], ...] = (
        ("username+ip", {"username": username, "ip": ip}, policy.max_failures_per_user,
         policy.window),
        ("ip", {"ip": ip}, policy.max_failures_per_ip, policy.window),
        ("username", {"username": username}, policy.max_failures_per_user_global,
         policy.global_window),
    )  # fmt: skip
    for scope, keys, limit, window in scopes:
        if not all(keys.values()):
            continue
        times = list(
            LoginFailure.objects.filter(**keys, at__gt=since)
            .order_by("at")
            .values_list("at", flat=True)
        )
        end = lockout_end(failures=times, limit=limit, window=window, lockout=policy.lockout)
        if end is not None and end > now:
            found.append(Lockout(scope=scope, until=end))
    return max(found, key=lambda item: item.until, default=None)
