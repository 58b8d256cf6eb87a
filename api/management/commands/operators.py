"""`manage.py operators create USERNAME [--no-input]`: password from a prompt or the environment."""

from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import CommandError

from api.management.base import NounCommand
from api.services.tenants import operator_create
from config.env import env_str

PASSWORD_ENV = "HARLI_OPERATOR_PASSWORD"


class Command(NounCommand):
    help = (
        "Create operators (console and /api/ops/). The password is prompted for, or read from "
        f"{PASSWORD_ENV} with --no-input."
    )

    def add_actions(self, subparsers: Any) -> None:
        create = subparsers.add_parser("create", help="create an operator")
        create.add_argument("username")
        create.add_argument("--email", default="")
        create.add_argument(
            "--no-input",
            "--noinput",
            action="store_false",
            dest="interactive",
            help=f"do not prompt; take the password from {PASSWORD_ENV}",
        )

    def action_create(self, *, username: str, email: str, interactive: bool, **_: Any) -> None:
        if interactive:
            password = getpass.getpass("Password: ")
            if password != getpass.getpass("Password (again): "):
                raise CommandError("The two passwords differ.")
        else:
            password = env_str(PASSWORD_ENV)
            if not password:
                raise CommandError(f"--no-input needs the password in {PASSWORD_ENV}.")
        user = operator_create(username=username, password=password, email=email)
        self.stdout.write(f"Created operator {user.username}.")
