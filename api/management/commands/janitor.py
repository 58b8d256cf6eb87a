"""`manage.py janitor`: one pass of the janitor (`api.services.janitor`), for operators.

Beat runs the same pass every HARLI_JANITOR_INTERVAL_S; this runs it now, on this machine (its
upload spool folder included: on a web host that runs no worker, from a timer).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand

from api.services.janitor import janitor_sweep


class Command(BaseCommand):
    help = (
        "Sweep crash litter (upload spool files, partial storage writes, stored objects "
        "without a row, expired idempotency keys) and prune metric samples, rollups and host "
        "reports' dedupe rows past their retention; print what was removed."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--verbose-names", action="store_true", help="list every removed file and object"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        for name, value in asdict(janitor_sweep()).items():
            if isinstance(value, list):
                self.stdout.write(f"{name}: {len(value)}")
                if options["verbose_names"]:
                    for item in value:
                        self.stdout.write(f"  {item}")
            else:
                self.stdout.write(f"{name}: {value}")
