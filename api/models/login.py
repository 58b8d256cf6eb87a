"""Failed sign-ins to the console, the record its login throttling counts.

Written only by `api.services.login_failures`, read by `api.login_throttle`. A row is one
refused sign-in; rows older than the throttle's lookback are pruned on every write, and a
successful sign-in deletes its username's rows.
"""

from __future__ import annotations

from django.db import models

# An IPv6 address in its longest text form (IPv4-mapped, "ffff:...:255.255.255.255").
IP_MAX_LENGTH = 45


class LoginFailure(models.Model):
    """One refused sign-in: the username as submitted (normalized by
    `api.login_throttle.login_username`), the client's address ("" when unknown), and when."""

    username = models.CharField(max_length=150)
    ip = models.CharField(max_length=IP_MAX_LENGTH)
    at = models.DateTimeField()

    class Meta:
        indexes = [
            models.Index(fields=["username", "at"], name="login_failure_username_at"),
            models.Index(fields=["ip", "at"], name="login_failure_ip_at"),
            models.Index(fields=["at"], name="login_failure_at"),  # pruning
        ]

    def __str__(self) -> str:
        return f"{self.username!r} from {self.ip or '?'} at {self.at.isoformat()}"
