"""`manage.py tenants create NAME | list | limits NAME [--rpm N|none] [--tpm N|none] |
quotas NAME [--running-jobs N|default] [--queued-jobs N|default] [--stored-bytes N|default]
[--trained-tokens-per-month N|default]`."""

from __future__ import annotations

import argparse
from typing import Any

from django.utils import timezone

from api.management.base import NounCommand
from api.quotas import QUOTA_NAMES, tenant_quota_states
from api.selectors import tenant_get, tenant_list
from api.services.quotas import tenant_quotas_set
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


# Given for a quota option: back to the fleet default.
DEFAULT = "default"


def quota_value(raw: str) -> int | None:
    """A quota as typed: an integer (the service checks its range), or "default"."""
    if raw.strip().lower() == DEFAULT:
        return None
    try:
        return int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer or {DEFAULT!r}") from None


def _shown(limit: int | None) -> str:
    return "unlimited" if limit is None else str(limit)


class Command(NounCommand):
    help = "Create and list tenants; set their rate limits and quotas."

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

        quotas = subparsers.add_parser(
            "quotas",
            help="show a tenant's quotas with their use, or set them (an option left out "
            "keeps its value)",
        )
        quotas.add_argument("name")
        for quota in QUOTA_NAMES:
            quotas.add_argument(
                "--" + quota.replace("_", "-"),
                dest=quota,
                type=quota_value,
                default=_KEEP,
                metavar="N|default",
                help=f"'{DEFAULT}' takes the fleet default",
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

    def action_quotas(self, *, name: str, **options: Any) -> None:
        tenant = tenant_get(name=name)
        changes = {q: options[q] for q in QUOTA_NAMES if options.get(q, _KEEP) is not _KEEP}
        if changes:
            tenant_quotas_set(tenant=tenant, changes=changes)
        rows = [
            (
                s.name,
                s.limit,
                "default" if s.override is None else "tenant",
                s.used,
                s.remaining,
            )
            for s in tenant_quota_states(tenant=tenant, now=timezone.now())
        ]
        self.stdout.write(f"Quotas of tenant {tenant.name}:")
        self.table(["QUOTA", "LIMIT", "SET BY", "USED", "REMAINING"], rows)
