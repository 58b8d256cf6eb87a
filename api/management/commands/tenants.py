"""`manage.py tenants create NAME | list | limits NAME [--rpm N|none] [--tpm N|none]`."""

from __future__ import annotations

import argparse
from typing import Any

from api.management.base import NounCommand
from api.selectors import tenant_get, tenant_list
from api.services.tenants import tenant_create, tenant_limits_set

# Given for --rpm / --tpm: no limit.
NO_LIMIT = "none"
_KEEP = object()


def limit_value(raw: str) -> int | None:
    """A limit as typed: an integer (the service checks its range), or "none" for no limit."""
    if raw.strip().lower() == NO_LIMIT:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer or {NO_LIMIT!r}") from None
    return value


def _shown(limit: int | None) -> str:
    return "unlimited" if limit is None else str(limit)


class Command(NounCommand):
    help = "Create and list tenants; set their rate limits."

    def add_actions(self, subparsers: Any) -> None:
        create = subparsers.add_parser("create", help="create a tenant (and its service user)")
        create.add_argument("name", help="lower-case slug: a-z, 0-9 and '-'")
        subparsers.add_parser("list", help="list tenants")
        limits = subparsers.add_parser(
            "limits",
            help="show or set a tenant's rate limits (an option left out keeps its value)",
        )
        limits.add_argument("name")
        for flag, what in (("--rpm", "requests"), ("--tpm", "tokens")):
            limits.add_argument(
                flag,
                type=limit_value,
                default=_KEEP,
                metavar="N|none",
                help=f"{what} per minute; '{NO_LIMIT}' removes the limit",
            )

    def action_create(self, *, name: str, **_: Any) -> None:
        tenant = tenant_create(name=name)
        self.stdout.write(f"Created tenant {tenant.name} (id {tenant.pk}).")

    def action_list(self, **_: Any) -> None:
        rows = [
            (
                t.pk,
                t.name,
                _shown(t.requests_per_minute),
                _shown(t.tokens_per_minute),
                t.created_at.isoformat(timespec="seconds"),
            )
            for t in tenant_list()
        ]
        self.table(["ID", "NAME", "RPM", "TPM", "CREATED"], rows)

    def action_limits(self, *, name: str, rpm: Any, tpm: Any, **_: Any) -> None:
        tenant = tenant_get(name=name)
        if rpm is not _KEEP or tpm is not _KEEP:
            tenant = tenant_limits_set(
                tenant=tenant,
                requests_per_minute=tenant.requests_per_minute if rpm is _KEEP else rpm,
                tokens_per_minute=tenant.tokens_per_minute if tpm is _KEEP else tpm,
            )
        self.stdout.write(
            f"Tenant {tenant.name}: {_shown(tenant.requests_per_minute)} requests/min, "
            f"{_shown(tenant.tokens_per_minute)} tokens/min."
        )
