"""Shared pieces of the admin CLI: domain errors become CommandError, tables print aligned."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from api.errors import HarliError


class NounCommand(BaseCommand):
    """A command with subcommands (`manage.py hosts register ...`).

    Subclasses define `add_actions(subparsers)` and one `action_<name>(**options)` per action.
    A HarliError from a service becomes a CommandError with its message (exit status 1).
    """

    def add_arguments(self, parser: CommandParser) -> None:
        subparsers = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
        self.add_actions(subparsers)

    def add_actions(self, subparsers: Any) -> None:
        raise NotImplementedError

    def handle(self, *args: Any, **options: Any) -> None:
        action = options.pop("action")
        method: Callable[..., None] = getattr(self, f"action_{action.replace('-', '_')}")
        try:
            method(**options)
        except HarliError as exc:
            raise CommandError(exc.message) from exc

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Print rows under headers, columns padded to their widest cell."""
        cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
        widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
        for line in [list(headers), *cells]:
            self.stdout.write(
                "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            )
        if not rows:
            self.stdout.write("(none)")
