"""`manage.py apikeys issue --tenant NAME | --operator USER`, `revoke PREFIX_OR_ID`, `list`."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from api.management.base import NounCommand
from api.models import User, UserRole
from api.selectors import api_key_list, tenant_get
from api.services.apikeys import api_key_issue, api_key_issue_for_tenant, api_key_revoke


class Command(NounCommand):
    help = "Issue, revoke and list API keys. A new key is shown once, alone on the last line."

    def add_actions(self, subparsers: Any) -> None:
        issue = subparsers.add_parser("issue", help="issue a key; prints it alone on the last line")
        owner = issue.add_mutually_exclusive_group(required=True)
        owner.add_argument("--tenant", help="issue for this tenant")
        owner.add_argument("--operator", help="issue for this operator (username)")
        issue.add_argument("--name", default="", help="a label for the key")
        revoke = subparsers.add_parser("revoke", help="revoke a key by prefix or id")
        revoke.add_argument("prefix_or_id", help="the key's prefix (hk-xxxxxxxx) or numeric id")
        listing = subparsers.add_parser("list", help="list keys (never the secrets)")
        listing.add_argument("--tenant", help="only this tenant's keys")

    def action_issue(
        self, *, tenant: str | None, operator: str | None, name: str, **_: Any
    ) -> None:
        if tenant:
            issued = api_key_issue_for_tenant(tenant=tenant_get(name=tenant), name=name)
            owner = f"tenant {tenant}"
        else:
            user = User.objects.filter(username=operator, role=UserRole.OPERATOR).first()
            if user is None:
                raise CommandError(f"No operator named {operator!r}.")
            issued = api_key_issue(user=user, name=name)
            owner = f"operator {operator}"
        self.stdout.write(
            f"Issued API key {issued.api_key.prefix} (id {issued.api_key.pk}) for {owner}. "
            "Store it now; it is not shown again:"
        )
        self.stdout.write(issued.key)

    def action_revoke(self, *, prefix_or_id: str, **_: Any) -> None:
        api_key = api_key_revoke(prefix_or_id=prefix_or_id)
        self.stdout.write(f"Revoked API key {api_key.prefix} (id {api_key.pk}).")

    def action_list(self, *, tenant: str | None, **_: Any) -> None:
        keys = api_key_list(tenant=tenant_get(name=tenant) if tenant else None)
        rows = [
            (
                k.pk,
                k.prefix,
                k.user.tenant.name if k.user.tenant else f"operator:{k.user.username}",
                k.name,
                k.created_at.isoformat(timespec="seconds"),
                k.last_used_at.isoformat(timespec="seconds") if k.last_used_at else None,
                "revoked" if k.revoked_at else "active",
            )
            for k in keys
        ]
        self.table(["ID", "PREFIX", "OWNER", "NAME", "CREATED", "LAST USED", "STATE"], rows)
