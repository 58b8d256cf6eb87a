"""`manage.py seed_demo`: the local demo's data, idempotent, with credentials printed.

Creates (when missing) the tenant `demo`, the `tiny` base model, the deployment `tiny-chat`,
and the operator `admin`; issues a fresh demo API key on every run (earlier demo keys are
revoked); writes a small training file (`var/demo/train.jsonl`); prints where to reach the API
and the console.
The operator's password comes from HARLI_OPERATOR_PASSWORD, or is generated on first creation
(an existing operator's password is left alone unless HARLI_OPERATOR_PASSWORD is set).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from api.errors import HarliError
from api.models import ApiKey, BaseModel, Deployment, Tenant, User, UserRole
from api.services.apikeys import api_key_issue_for_tenant, api_key_revoke
from api.services.fleet import base_model_register, deployment_create
from api.services.tenants import operator_create, tenant_create
from config.env import env_str

DEMO_TENANT = "demo"
DEMO_KEY_NAME = "demo"
OPERATOR = "admin"
EXAMPLES = [
    ("What is the capital of France?", "Paris."),
    ("What is 2 + 2?", "4."),
    ("Name a primary colour.", "Red."),
]


class Command(BaseCommand):
    help = "Seed the local demo (tenant, key, tiny model, deployment, operator) and print access."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000", help="where the server runs")

    def handle(self, *args: Any, url: str, **options: Any) -> None:
        try:
            with transaction.atomic():
                key, operator_note = self._seed()
        except HarliError as exc:
            raise CommandError(exc.message) from exc
        train = Path(settings.DATA_DIR) / "demo" / "train.jsonl"
        train.parent.mkdir(parents=True, exist_ok=True)
        train.write_text(
            "".join(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": q},
                            {"role": "assistant", "content": a},
                        ]
                    }
                )
                + "\n"
                for q, a in EXAMPLES
            )
        )
        url = url.rstrip("/")
        self.stdout.write(
            f"""
Harli is starting at {url}
  tenant API (OpenAI shape):  {url}/v1
  operator API:               {url}/api/ops/
  API docs (Swagger UI):      {url}/api/docs/
  operator console:           {url}/console/   {operator_note}
  demo tenant API key:        {key}
  demo training file:         {train}
"""
        )

    def _seed(self) -> tuple[str, str]:
        tenant = Tenant.objects.filter(name=DEMO_TENANT).first() or tenant_create(name=DEMO_TENANT)
        if not BaseModel.objects.filter(name="tiny").exists():
            base_model_register(name="tiny", preset="tiny")
        if not Deployment.objects.filter(name="tiny-chat").exists():
            deployment_create(
                name="tiny-chat",
                base_model=BaseModel.objects.get(name="tiny"),
                tpot_slo_ms=50.0,
                ttft_slo_ms=500.0,
                slo_attainment_target_pct=99.0,
            )
        for old in ApiKey.objects.filter(
            user__tenant=tenant, name=DEMO_KEY_NAME, revoked_at__isnull=True
        ):
            api_key_revoke(prefix_or_id=old.prefix)
        key = api_key_issue_for_tenant(tenant=tenant, name=DEMO_KEY_NAME).key

        password = env_str("HARLI_OPERATOR_PASSWORD")
        operator = User.objects.filter(username=OPERATOR).first()
        if operator is None:
            password = password or secrets.token_urlsafe(12)
            operator_create(username=OPERATOR, password=password)
            note = f"(user {OPERATOR}, password {password})"
        elif operator.role != UserRole.OPERATOR:
            raise CommandError(f"User {OPERATOR!r} exists but is not an operator.")
        elif password:
            operator.set_password(password)
            operator.save(update_fields=["password"])
            note = f"(user {OPERATOR}, password from HARLI_OPERATOR_PASSWORD)"
        else:
            note = f"(user {OPERATOR}; password unchanged, set HARLI_OPERATOR_PASSWORD to reset it)"
        return key, note
