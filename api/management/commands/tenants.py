"""`manage.py tenants create NAME | list`."""

from __future__ import annotations

from typing import Any

from api.management.base import NounCommand
from api.selectors import tenant_list
from api.services.tenants import tenant_create


class Command(NounCommand):
    help = "Create and list tenants."

    def add_actions(self, subparsers: Any) -> None:
        create = subparsers.add_parser("create", help="create a tenant (and its service user)")
        create.add_argument("name", help="lower-case slug: a-z, 0-9 and '-'")
        subparsers.add_parser("list", help="list tenants")

    def action_create(self, *, name: str, **_: Any) -> None:
        tenant = tenant_create(name=name)
        self.stdout.write(f"Created tenant {tenant.name} (id {tenant.pk}).")

    def action_list(self, **_: Any) -> None:
        rows = [(t.pk, t.name, t.created_at.isoformat(timespec="seconds")) for t in tenant_list()]
        self.table(["ID", "NAME", "CREATED"], rows)
